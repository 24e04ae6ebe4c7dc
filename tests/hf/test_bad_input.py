"""Bad model input is one line and a non-zero exit, before anything runs: a model.path that is
not an HF model dir, a tokenizer without the chat template the env's messages need, LoRA targets
the model does not have, and a resumed run whose model dir changed."""

from __future__ import annotations

import shutil

import orjson
import pytest
from click.testing import CliRunner

from orchestrator.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, ["run", *args])


def _error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    return lines[-1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d, "is not a directory"),
        (lambda d: (d.mkdir(), d)[1], "is not a Hugging Face model dir: it has no config.json"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{}"), d)[2], "config.json has no model_type"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "llama"}'), d)[2], "holds no weights"),
    ],
)
def test_a_model_path_that_is_not_a_model_dir(tmp_path, make, message):
    path = make(tmp_path / "model")
    result = _run("--runs-dir", str(tmp_path / "runs"), "--name", "r", "--set", f"model.path={path}")
    line = _error_line(result)
    assert result.exit_code == 2 and line.startswith(f"orch: error: model.path {path}") and message in line
    assert not (tmp_path / "runs" / "r").exists()  # nothing ran, nothing was created


def test_a_tokenizer_without_a_chat_template_when_the_env_gives_messages(tmp_path, model_dir):
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").unlink()
    config = orjson.loads((plain / "tokenizer_config.json").read_bytes())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    result = _run("--runs-dir", str(tmp_path / "runs"), "--name", "r", "--set", f"model.path={plain}")
    assert _error_line(result) == (
        f"orch: error: model.path {plain}: the env gives chat messages, but the tokenizer has no chat template"
    )


def test_lora_targets_the_model_does_not_have(tmp_path, model_dir):
    result = _run(
        "--runs-dir",
        str(tmp_path / "runs"),
        "--name",
        "r",
        "--set",
        f"model.path={model_dir}",
        "--set",
        "trainer.hf.lora.rank=4",
        "--set",
        'trainer.hf.lora.target_modules=["q_proj","c_attn"]',
    )
    line = _error_line(result)
    assert line.startswith("orch: error: trainer.hf.lora.target_modules ['c_attn']: the model at ")
    assert "q_proj" in line and "gate_proj" in line  # it lists the linear layers there are


def test_a_resumed_run_whose_model_dir_changed(tmp_path, model_dir):
    from orchestrator.config import load_config
    from orchestrator.shell.runner import create_run

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    run = create_run(load_config(overrides=[f"runs_dir={tmp_path}", "name=r", f"model.path={model}"]))
    run.log.close()
    run.started_early.close()  # the trainer it started: this run never runs
    (model / "generation_config.json").write_text('{"do_sample": true}')  # any change to the dir's files
    result = CliRunner().invoke(main, ["run", "--resume", str(tmp_path / "r")])
    assert _error_line(result).startswith(f"orch: error: the model dir {model} changed since the run started")
    assert result.exit_code == 2


@pytest.mark.parametrize("key", ["clip_high", "truncate_at"])
def test_a_non_finite_loss_option_is_refused_in_one_line(tmp_path, key):
    result = _run("--runs-dir", str(tmp_path / "runs"), "--name", "r", "--set", f"trainer.hf.loss.{key}=inf")
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        f"orch: error: invalid config: trainer.hf.loss.{key}: Input should be a finite number"
    ]
    assert not (tmp_path / "runs" / "r").exists()

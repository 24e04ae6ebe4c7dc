"""Bad input for a run on vLLM: one line (`orch: error: ...`), a non-zero exit, before anything
runs (no run directory)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.envs.server import running_server
from tests.inference.util import REPO, replaying_vllm
from tests.inference.vllm_util import needs_vllm
from tests.support.cli import orch
from tests.support.runs import sets


def model_dir(path: Path, head_dim: int = 32, chat_template: bool = True) -> Path:
    """An HF model dir as far as the checks read it: config.json and the tokenizer."""
    from orchestrator.hf.tiny_model import build_tokenizer

    path.mkdir()
    heads = 4
    (path / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": heads * head_dim, "num_attention_heads": heads})
    )
    tokenizer = build_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"")  # the checks before a run read no weights
    return path


def orch_run(tmp_path: Path, *assignments: str) -> subprocess.CompletedProcess:
    args = ["run", "--runs-dir", str(tmp_path / "runs"), "--name", "r", "--max-steps", "2", *sets(*assignments)]
    return orch(*args, cwd=REPO, timeout=120, check=False)


def assert_one_line_error(done: subprocess.CompletedProcess, tmp_path: Path, *words: str) -> None:
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: "), done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "runs" / "r").exists()  # nothing ran


def test_a_model_path_that_is_not_an_hf_model_dir(tmp_path):
    (tmp_path / "weights").mkdir()
    done = orch_run(
        tmp_path,
        f"model.path={tmp_path / 'weights'}",
        "inference.openai.weight_sync=vllm_reload",
        "inference.openai.launch.servers=1",
    )
    assert_one_line_error(done, tmp_path, "is not a Hugging Face model dir", str(tmp_path / "weights"))


def test_a_tokenizer_without_a_chat_template(tmp_path):
    model = model_dir(tmp_path / "m", chat_template=False)
    done = orch_run(
        tmp_path, f"model.path={model}", "inference.openai.weight_sync=vllm_reload", "inference.openai.launch.servers=1"
    )
    assert_one_line_error(done, tmp_path, "has no chat template")


def test_an_endpoint_serving_another_model(tmp_path):
    model = model_dir(tmp_path / "m")
    with running_server(replaying_vllm([])) as vllm:  # what a vLLM serving /models/tiny answers
        done = orch_run(
            tmp_path,
            f"model.path={model}",
            "inference.openai.weight_sync=vllm_reload",
            f'inference.openai.endpoints=["{vllm.base_url}"]',
        )
    assert_one_line_error(done, tmp_path, f"{vllm.base_url} serves /models/tiny, not this run's model {model}")


def test_vllm_not_installed_when_asked_to_launch_it(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    config = load_config(
        None,
        [
            f"model.path={model_dir(tmp_path / 'm')}",
            "inference.openai.weight_sync=vllm_reload",
            "inference.openai.launch.servers=1",
            f"runs_dir={tmp_path}",
        ],
    )
    with pytest.raises(ConfigError, match="vLLM is not installed in .*make vllm"):
        config.inference.openai.preflight(config.model.path)


@needs_vllm
def test_a_head_dim_the_cpu_backend_does_not_support(tmp_path):
    model = model_dir(tmp_path / "m", head_dim=48)
    done = orch_run(
        tmp_path, f"model.path={model}", "inference.openai.weight_sync=vllm_lora", "inference.openai.launch.servers=1"
    )
    assert_one_line_error(done, tmp_path, "attention heads of size 48", "CPU backend does not support")
    # On GPUs the CPU backend's limits do not apply: no error from this check.
    on_gpus = load_config(
        None,
        [
            f"model.path={model}",
            "inference.openai.weight_sync=vllm_lora",
            "inference.openai.launch.servers=1",
            'inference.openai.launch.gpus=["0"]',
        ],
    )
    on_gpus.inference.openai.preflight(model)


@needs_vllm
def test_a_launched_server_that_exits_is_one_error_naming_it_and_its_log(tmp_path):
    """A server that dies before it serves (here: a flag vLLM does not know) ends the wait at
    once with its exit code, its last log line and where the log is; its process group is gone."""
    import asyncio

    from orchestrator.inference.endpoints_config import LaunchSection
    from orchestrator.inference.vllm_launch import LaunchError, VllmLauncher, group_alive

    launcher = VllmLauncher(
        LaunchSection(servers=1, extra_args=["--no-such-flag"], ready_timeout_s=120),
        model_dir(tmp_path / "m"),
        tmp_path / "run",
        "vllm_reload",
        2,
    )
    try:
        launcher.start()
        with pytest.raises(LaunchError) as err:
            asyncio.run(launcher.wait_ready())
    finally:
        launcher.stop()
    message = str(err.value)
    assert message.startswith(f"vLLM server 0 ({launcher.urls[0]}) exited with code ") and "--no-such-flag" in message
    assert str(tmp_path / "run" / "logs" / "vllm-0.log") in message
    assert not group_alive(launcher.servers[0].proc.pid)

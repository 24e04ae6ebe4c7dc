"""Config knobs and wiring: `inference.*`, `trainer.hf.*`, `orch run --inference`, the torchrun command."""

from __future__ import annotations

import re
import sys

import pytest

from orchestrator.config import ConfigError, load_config, meaning_changes
from orchestrator.contracts import PreparedModel
from orchestrator.hf.distributed import torchrun_command
from orchestrator.hf.factory import write_trainer_json
from orchestrator.inference.endpoints_backend import EndpointsBackend
from orchestrator.trainers.process import ProcessTrainer
from orchestrator.trainers.torchrun import TorchrunTrainer
from tests.support.parts import parts_of
from tests.support.runs import fake_run_args


def test_defaults_keep_the_embedded_single_process_job():
    c = load_config()
    assert c.inference.openai.endpoints == [] and c.inference.openai.weight_sync == "orch"
    assert c.inference_kind() == "embedded" and c.trainer.kind == "hf" and c.trainer.hf.nproc == 1
    assert c.model.path is None and c.trainer.hf.lora.rank == 0


def test_endpoints_refuse_a_synthetic_env():
    with pytest.raises(ConfigError, match="inference endpoints sample the model, not the fake env's episodes"):
        load_config(overrides=['envs={"fake": 1}', "trainer.kind=fake", 'inference.openai.endpoints=["http://x:1"]'])


@pytest.mark.parametrize(
    "endpoints, message",
    [
        (["http://127.0.0.1:9", "127.0.0.1:9/"], "endpoints 'http://127.0.0.1:9' and '127.0.0.1:9/' are the same"),
        (["http://h:1/v1", "h:1"], "endpoints 'http://h:1/v1' and 'h:1' are the same"),
        (["http://127.0.0.1:80x0"], "endpoint 'http://127.0.0.1:80x0' has an invalid host or port"),
        (["http://127.0.0.1:99999"], "endpoint 'http://127.0.0.1:99999' has an invalid host or port"),
        (["http://[::1"], "endpoint 'http://[::1' has an invalid host or port"),
        (["http://h :1"], "endpoint 'http://h :1' is not an http(s)://host[:port] URL"),
        (["http://user@h:1"], "endpoint 'http://user@h:1' is not an http(s)://host[:port] URL"),
        (["http://h:1/?x=1"], "endpoint 'http://h:1/?x=1' is not an http(s)://host[:port] URL"),
        (["http://h:"], "endpoint 'http://h:' is not an http(s)://host[:port] URL"),
        (["ftp://x"], "endpoint 'ftp://x' is not an http(s)://host[:port] URL"),
        (["http://"], "endpoint 'http://' is not an http(s)://host[:port] URL"),
    ],
)
def test_endpoints_must_be_distinct_http_urls(endpoints, message):
    """Checked with the config (exit 2 before anything runs): the client used to raise at build
    time (a traceback) or fail each request until the publish timeout."""
    quoted = ",".join(f'"{url}"' for url in endpoints)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=[f"inference.openai.endpoints=[{quoted}]"])


def test_endpoints_and_ranks_may_change_on_resume_but_the_weight_protocol_may_not():
    a = load_config()
    b = load_config(
        overrides=[
            'inference.openai.endpoints=["http://a:1","http://b:2"]',
            "trainer.hf.nproc=4",
            "inference.openai.max_attempts=5",
            "trainer.hf.distributed=fsdp",
            "trainer.hf.backend=gloo",
        ]
    )
    assert meaning_changes(a, b) == []
    changed = meaning_changes(a, load_config(overrides=["inference.openai.weight_sync=none"]))
    assert changed == ["inference.openai.weight_sync"]


def test_the_config_picks_the_endpoints_backend_and_torchrun(tmp_path):
    from orchestrator.hf.tiny_model import build_untrained

    model, tokenizer = build_untrained()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config = load_config(
        overrides=[
            f"runs_dir={tmp_path}",
            "name=r",
            'inference.openai.endpoints=["127.0.0.1:9/v1"]',
            "inference.openai.preflight_timeout_s=0",  # the wiring, not the endpoint: nothing listens there
            "trainer.hf.nproc=2",
            "trainer.hf.backend=gloo",
            f"model.path={tmp_path / 'model'}",
        ]
    )
    parts = parts_of(config)
    assert isinstance(parts.backend, EndpointsBackend) and parts.backend.follows_weights
    assert [e.url for e in parts.backend.client.endpoints] == ["http://127.0.0.1:9"]
    assert isinstance(parts.trainer, TorchrunTrainer) and isinstance(parts.trainer, ProcessTrainer)
    assert (
        parts.trainer.command()
        == torchrun_command(tmp_path / "r", nproc=2)
        == [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "-m",
            "orchestrator.cli",
            "trainer",
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    assert torchrun_command(tmp_path, nproc=4, nnodes=2, node_rank=1, rdzv_endpoint="h:29400")[3:9] == [
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:29400",
        "--rdzv-id=orch",
        "--nproc-per-node=4",
    ]


def test_cli_inference_shorthand(tmp_path):
    from click.testing import CliRunner

    from orchestrator.cli import main

    # A bad URL list still parses into the config; the fake env refuses it with one line.
    result = CliRunner().invoke(
        main,
        fake_run_args(tmp_path, None, "--inference", "http://a:1, http://b:2"),
    )
    assert (
        result.exit_code == 2 and "inference endpoints sample the model, not the fake env's episodes" in result.output
    )


@pytest.mark.parametrize("target_lag, kept", [(0, 3), (1, 3), (4, 6)])
def test_the_trainer_keeps_every_version_a_resume_may_reload(tmp_path, target_lag, kept):
    """After a crash the trainer may have published target_lag + 1 versions the log has not
    recorded; the newest recorded one, which a resume reloads, must still be on disk."""
    from orchestrator.hf.trainer import read_trainer_config  # imports torch

    config = load_config(overrides=[f"off_policy.target_lag={target_lag}"])
    ctx = config.build_context(tmp_path, version_now=lambda: 0)
    write_trainer_json(config.trainer.hf, ctx, PreparedModel(tmp_path / "model", ""))
    assert read_trainer_config(tmp_path).keep_weights == kept


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["inference.openai.weight_sync=vllm_lora"], "update_mode 'interrupt' needs weight_sync 'vllm_reload'"),
        (["inference.openai.weight_sync=sglang"], "update_mode 'interrupt' needs weight_sync 'vllm_reload'"),
    ],
)
def test_an_update_mode_the_weight_sync_cannot_do_is_one_line(overrides, message):
    base = ['inference.openai.endpoints=["http://h:1"]', "inference.openai.update_mode=interrupt"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=base + overrides)


@pytest.mark.parametrize(
    ("weight_sync", "in_use"), [("vllm_reload", "interrupt"), ("vllm_lora", "wait"), ("orch", "wait")]
)
def test_update_mode_defaults_to_interrupt_where_the_weight_sync_can(weight_sync, in_use):
    c = load_config(
        overrides=['inference.openai.endpoints=["http://h:1"]', f"inference.openai.weight_sync={weight_sync}"]
    )
    assert c.inference.openai.update_mode is None and c.inference.openai.update_mode_in_use == in_use


@pytest.mark.parametrize("weight_sync", ["vllm_reload", "vllm_push"])
def test_update_mode_keep_is_offered_by_the_vllm_full_weight_syncs(weight_sync):
    c = load_config(
        overrides=[
            'inference.openai.endpoints=["http://h:1"]',
            f"inference.openai.weight_sync={weight_sync}",
            "inference.openai.update_mode=keep",
        ]
    )
    assert c.inference.openai.update_mode_in_use == "keep"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["inference.openai.weight_sync=vllm_lora"], "update_mode 'keep' needs weight_sync 'vllm_reload'"),
        (
            ['inference.openai.routers=[{"url": "http://r:1", "engines": ["http://e:1"]}]'],
            "update_mode 'keep' is not offered through routers",
        ),
    ],
)
def test_update_mode_keep_where_it_cannot_work_is_one_line(overrides, message):
    base = ["inference.openai.update_mode=keep", "inference.openai.weight_sync=vllm_reload"]
    if not any("routers" in o for o in overrides):
        base.append('inference.openai.endpoints=["http://h:1"]')
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=base + overrides)

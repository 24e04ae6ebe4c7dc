"""The trainer's push side as a process of its own, for the tests and benches against a real vLLM
server: :class:`PushTrainer` runs tests/weight_push/push_trainer.py (the sender and push service a
trainer process runs, holding each version published in a run dir); :func:`wide_model` builds a
model large enough that moving its bytes is most of a load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from orchestrator import rundir
from tests.inference.util import REPO


class PushTrainer:
    """The stand-in trainer process for ``run_dir``, started with push_trainer.py's ``args``;
    stopped (its stdin closed, then killed) by `stop` or on leaving its ``with``."""

    def __init__(self, run_dir: Path, *args: str, transport: str = "gloo"):
        self.run_dir = run_dir
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"} if transport == "nccl" else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.weight_push.push_trainer", str(run_dir), "--transport", transport, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            cwd=REPO,
            env=env,
        )
        deadline = time.monotonic() + 120
        while self._info().get("pid") != self.proc.pid:  # ready once its service listens (not a dead one's)
            assert self.proc.poll() is None, "the trainer stand-in exited"
            assert time.monotonic() < deadline, "the trainer stand-in did not start within 120s"
            time.sleep(0.1)

    def _info(self) -> dict:
        """What push.json says (empty: none yet)."""
        try:
            return json.loads((rundir.weights_root(self.run_dir) / "push.json").read_text())
        except (OSError, ValueError):
            return {}

    def __enter__(self) -> PushTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def holds(self, version: int, timeout: float = 120) -> None:
        """Wait until it holds ``version`` (it reads each version once it is STABLE)."""
        url = self._info()["url"]
        deadline = time.monotonic() + timeout
        while json.loads(urllib.request.urlopen(url + "/metadata", timeout=10).read())["version"] != version:
            assert time.monotonic() < deadline, f"the trainer stand-in did not hold version {version}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def gpus_for_nccl() -> bool:
    """Two CUDA devices or more: the trainer on one, a server on another."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def wide_model(path: Path, base: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The tiny model's architecture and tokenizer, wider and deeper (134M parameters: 537 MB in
    fp32, 269 MB in bf16), randomly initialised: a size where moving the bytes is most of a load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(base)
    config.update(
        {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "head_dim": 64}
        | {"num_attention_heads": 16, "num_key_value_heads": 16}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return path

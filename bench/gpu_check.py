"""`make gpu-check`: the weight push over NCCL on a machine with CUDA, downloading nothing.

1. the push's exactness tests (tests/inference/test_vllm_push.py) over NCCL: the trainer stand-in
   on GPU 0, a vLLM server on GPU 1, each version's logprobs against a disk reload's and a
   transformers recompute;
2. a 20-step `orch run` of the tiny reverse_text model (built locally) with ``vllm_push`` over
   NCCL: the hf trainer on GPU 0, one vLLM server orch launches on GPU 1;
3. its figures: the tests' printed lines, the run's seconds, steps, reward at the start and the
   end, and the versions pushed.

Needs two GPUs or more (an NCCL group cannot have two ranks on one GPU) and, in this Python,
torch with CUDA, vLLM's CUDA build and orch installed (its entry points). Each missing piece is
one line and exit 1.

    python -m bench.gpu_check [--steps 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def missing() -> str | None:
    """What this machine lacks for the check, in one line; None: nothing."""
    import torch

    if not torch.cuda.is_available():
        return f"torch in {sys.executable} has no CUDA ({torch.__version__}): run this where the GPUs are"
    if torch.cuda.device_count() < 2:
        return "the push over NCCL needs two GPUs (the trainer on one, a server on another); this machine has one"
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed in {sys.executable} (its CUDA build, the version orch pins)"
    return None


def run_tests() -> int:
    env = {**os.environ, "ORCH_PUSH_TRANSPORTS": "nccl", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-m", "slow", "-o", "addopts=-p no:cacheprovider"]
    return subprocess.call([*argv, "tests/inference/test_vllm_push.py"], cwd=REPO, env=env)


def run_orch(steps: int, runs_dir: Path) -> tuple[int, float]:
    from tests.inference.vllm_util import tiny_model

    sets = {
        "model.path": str(tiny_model()),
        "inference.openai.weight_sync": "vllm_push",
        "inference.openai.update_mode": "interrupt",
        "inference.openai.launch.gpus": '["1"]',
        "inference.openai.launch.extra_args": json.dumps(
            ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3"]
        ),
        "trainer.hf.push.transport": "nccl",
    }
    argv = [sys.executable, "-m", "orchestrator.cli", "run", "--config", "examples/reverse_text_hf.toml"]
    argv += ["--runs-dir", str(runs_dir), "--name", "gpu-check", "--max-steps", str(steps)]
    argv += [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    started = time.monotonic()
    code = subprocess.call(argv, cwd=REPO)
    return code, time.monotonic() - started


def figures(run_dir: Path, seconds: float) -> str:
    from tests.support.logs import events

    rewards = [e["reward_mean"] for _, e in events(run_dir, "batch_shipped")]
    versions = [e["version"] for _, e in events(run_dir, "version_published")]
    window = min(5, len(rewards))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("vllm-*.log"))
    pushed = logs.count('"POST /update_weights HTTP/1.1" 200')
    return (
        f"gpu-check run: {len(rewards)} steps in {seconds:.0f} s ({seconds / max(1, len(rewards)):.1f} s/step), "
        f"reward {first:.3f} (first {window}) -> {last:.3f} (last {window}), {len(versions)} versions published, "
        f"{pushed} pushes answered 200"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if (lack := missing()) is not None:
        print(f"gpu-check: {lack}", file=sys.stderr)
        return 1
    if (code := run_tests()) != 0:
        print(f"gpu-check: the push's tests over NCCL failed (exit {code})", file=sys.stderr)
        return code
    with tempfile.TemporaryDirectory(prefix="orch-gpu-check-") as runs:
        code, seconds = run_orch(args.steps, Path(runs))
        if code != 0:
            print(f"gpu-check: the {args.steps}-step run failed (exit {code})", file=sys.stderr)
            return code
        print(figures(Path(runs) / "gpu-check", seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

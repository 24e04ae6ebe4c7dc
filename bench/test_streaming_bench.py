"""orch's CPU per token of a completion, streamed (update_mode interrupt) and unstreamed, against a
stand-in engine in another process that streams vLLM 0.32's /v1/completions chunks as fast as it
can (`tests/inference/stream_standin.py`: the engine taken out, what is left is orch's client).

Sides: streamed with vLLM's ``stream_interval`` at 1 (one token per chunk), 8 and the setting's
default (`STREAM_INTERVAL`), and unstreamed; the garbage collector tuned as in a run. Shapes
(completions in flight x tokens each): 64 x 256, 256 x 2k, 64 x 16k. Per shape: a warm-up round of
each side not counted, then ROUNDS rounds, the order alternated; a side's figure is this
process's CPU time (`time.process_time`: the client's, not the engine's) over the round's
gather, per token. ``extra_info``: each side's median and spread (min, max) in CPU µs per token,
the paired ratios to unstreamed, and the tokens one CPU second consumes (the ceiling of one orch
process, whose client is its busiest part). Fails only on a broken invariant (a choice not the one the
stand-in sampled).

Where there are two cores, the engine is pinned to one and this process to the other.
Run: ``.venv/bin/python -m pytest bench/test_streaming_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import pytest

from bench.paired import alternated_rounds, paired_ratio
from orchestrator.gc_tuning import tuned_gc
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.endpoints_config import STREAM_INTERVAL
from tests.inference.stream_standin import expected_choice, standin_process

ROUNDS = 6
SHAPES = [(64, 256), (256, 2048), (64, 16384)]
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def engine():
    two_cores = len(os.sched_getaffinity(0)) >= 2
    mine = os.sched_getaffinity(0)
    with standin_process(cpu=1 if two_cores else None) as url:
        if two_cores:
            os.sched_setaffinity(0, {0})
        try:
            yield url
        finally:
            os.sched_setaffinity(0, mine)


def sides(url: str) -> dict[str, InferenceClient]:
    streamed = {
        f"streamed, interval {interval}": InferenceClient(
            [url], weight_sync="vllm_reload", update_mode="interrupt", stream_interval=interval
        )
        for interval in sorted({1, 8, STREAM_INTERVAL})
    }
    return {**streamed, "unstreamed": InferenceClient([url], weight_sync="vllm_reload", update_mode="wait")}


@pytest.mark.parametrize("concurrency,length", SHAPES, ids=[f"{c}x{n}" for c, n in SHAPES])
def test_cpu_per_token_streamed_and_unstreamed(benchmark, engine, concurrency, length):
    async def main() -> dict[str, list[float]]:
        clients = sides(engine)
        seeds = iter(range(10**9))

        def side(client: InferenceClient):
            async def one_round() -> float:
                batch = [next(seeds) for _ in range(concurrency)]
                cpu = time.process_time()
                got = await asyncio.gather(*(client.complete(PROMPT, max_tokens=length, seed=s) for s in batch))
                cpu = time.process_time() - cpu
                for seed in (batch[0], batch[-1]):  # the invariant: the choice the engine sampled
                    choice = got[batch.index(seed)].choices[0]
                    assert choice.token_ids == expected_choice(seed, 0, length)[0]
                assert sum(len(c.choices[0].token_ids) for c in got) == concurrency * length
                return cpu / (concurrency * length) * 1e6

            return one_round

        try:
            return await alternated_rounds(ROUNDS, {name: side(c) for name, c in clients.items()})
        finally:
            for client in clients.values():
                await client.aclose()

    with tuned_gc():  # as in a run (orchestrator/shell/runner.py)
        figures = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    summary = {
        name: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
        for name, v in figures.items()
    }
    ratios = {
        f"{name} / unstreamed": paired_ratio(v, figures["unstreamed"])
        for name, v in figures.items()
        if name != "unstreamed"
    }
    ceiling = {name: round(1e6 / statistics.median(v)) for name, v in figures.items()}
    benchmark.extra_info.update(
        shape=f"{concurrency}x{length}", cpu_us_per_token=summary, paired_ratios=ratios, tokens_per_cpu_s=ceiling
    )
    print(
        f"\n{concurrency}x{length} CPU µs/token: {summary}; tokens per CPU second: {ceiling}; paired: "
        + "; ".join(f"{k} {r['median']} ({r['min']}-{r['max']})" for k, r in ratios.items())
    )

"""Rollout collection benchmarks.

1. Consumer wake-ups: 1,024 rollouts finishing one at a time while consumers are parked.
   ``queue``: our ``run_examples`` (one queue notification per finished rollout).
   ``shared_event``: a baseline implemented here, where every finished rollout sets one shared
   ``asyncio.Event`` and every parked consumer wakes, re-checks and re-parks.
   ``extra_info["resumptions"]`` counts consumer resumptions (every time the loop resumes a
   consumer coroutine), measured the same way for both.
2. Per-example overhead of ``run_examples`` with an instant ``fn`` (examples/s), fed and taken
   as the orchestrator does (``ExampleFeed.put``, ``take_ready``), next to bare ``asyncio`` tasks
   doing the same work.

Run: ``.venv/bin/python -m pytest bench/test_rollouts_bench.py -o addopts= --benchmark-only``
"""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.collection.collect import ExampleFeed, run_examples
from tests.support.wakeups import SharedEventStream, arrival_workload, rollouts_of

N_ARRIVALS = 1024
N_EXAMPLES = 20_000


IMPLS = {"queue": rollouts_of, "shared_event": SharedEventStream}
SHAPES = {
    # (consumers, looping): 1,024 eager consumers each taking one outcome (the spec's workload),
    # and 8 consumers each waiting and taking until the end.
    "eager_1024": (None, False),
    "loop_8": (8, True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_consumer_wakeups(benchmark, impl, shape):
    consumers, looping = SHAPES[shape]
    results: list[dict[str, int]] = []

    def run() -> None:
        results.append(asyncio.run(arrival_workload(IMPLS[impl], N_ARRIVALS, consumers, looping=looping)))

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)
    stats = results[-1]
    assert all(r == stats for r in results), "wake-up counts must be deterministic"
    assert stats["delivered"] == stats["distinct"] == N_ARRIVALS
    benchmark.extra_info.update(
        impl=impl,
        shape=shape,
        outcomes=N_ARRIVALS,
        resumptions=stats["resumptions"],
        resumptions_per_outcome=round(stats["resumptions"] / N_ARRIVALS, 3),
    )
    if impl == "queue":
        extra = 0 if consumers is None else consumers - 1  # end-of-stream wake of the others
        assert stats["resumptions"] == N_ARRIVALS + extra


async def _instant(x: int) -> int:
    return x


async def _run_examples_feed_batches() -> int:
    """The orchestrator's shape: submit over time through a feed, consume in batches."""
    feed: ExampleFeed[int] = ExampleFeed()
    stream = run_examples(feed, _instant, max_concurrency=1024)
    n = 0
    for i in range(N_EXAMPLES):
        feed.put(i)
        if i % 256 == 255:
            await asyncio.sleep(0)
            n += len(stream.take_ready())
    feed.close()
    while await stream.wait_ready(10):
        n += len(stream.take_ready())
    return n


async def _bare_tasks() -> int:
    """Reference: one plain asyncio task per example, gathered (no streaming, no bookkeeping)."""
    results = await asyncio.gather(*(asyncio.ensure_future(_instant(i)) for i in range(N_EXAMPLES)))
    return len(results)


OVERHEAD = {
    "run_examples_feed_take_ready": _run_examples_feed_batches,
    "bare_asyncio_tasks": _bare_tasks,
}


@pytest.mark.parametrize("variant", list(OVERHEAD))
def test_per_example_overhead(benchmark, variant):
    def run() -> None:
        assert asyncio.run(OVERHEAD[variant]()) == N_EXAMPLES

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        mean = stats.stats.mean
        benchmark.extra_info.update(
            examples=N_EXAMPLES,
            examples_per_s=round(N_EXAMPLES / mean),
            us_per_example=round(mean / N_EXAMPLES * 1e6, 2),
        )

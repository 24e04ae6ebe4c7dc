"""orch's per-episode overhead on top of verifiers' own, on one run of the `verifiers` env.

The tiny model on a real vLLM-CPU server; the `orch_reverse_text` taskset (one turn) through
`VerifiersRollouts`, the backend `orch run` uses, N_EPISODES episodes, EPISODES_AT_ONCE at a time.
Per episode, reported separately:

* ``verifiers_ms``: inside verifiers' `run_slot` (the harness subprocess, its model calls, scoring);
* ``orch_route_ms``: orch's routing of those model calls beyond their HTTP exchange with vLLM
  (endpoint choice, version check, JSON, the logprob shape) — part of ``verifiers_ms``;
* ``orch_ms``: the rest of the episode, orch's own (task draw, branch to sample, versions).

Only broken invariants fail it (every episode ok, its sample non-empty), never a ratio.
Run: ``.venv/bin/python -m pytest bench/test_verifiers_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1")

from tests.verifiers.util import EXAMPLES, tiny_model, vllm_server  # noqa: E402

N_EPISODES = 8
EPISODES_AT_ONCE = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("verifiers-bench")
    model = tiny_model()
    with vllm_server(model, root / "vllm.log") as url:
        yield model, url


def test_orch_overhead_per_verifiers_episode(benchmark, served, tmp_path):
    from orchestrator.envs.verifiers import VerifiersRollouts
    from orchestrator.envs.verifiers_config import VerifiersSection
    from orchestrator.inference.client import InferenceClient
    from orchestrator.shell.rollouts import RolloutRequest

    model, url = served
    section = VerifiersSection(taskset="orch_reverse_text", path=[str(EXAMPLES / "verifiers_tasksets")],
                               model=str(model), max_turns=1)

    async def episodes():
        client = InferenceClient([url], weight_sync="none")
        backend = VerifiersRollouts(tmp_path, section, client, seed=0, temperature=1.0, max_tokens=24,
                                    load_timeout_s=60)
        await backend.start()
        try:
            await backend.load(0)
            gate = asyncio.Semaphore(EPISODES_AT_ONCE)

            async def one(i: int):
                async with gate:
                    return await backend(RolloutRequest(i, i // 2, "verifiers", i // 2, 0, 0))

            async with asyncio.TaskGroup() as tg:
                done = [tg.create_task(one(i)) for i in range(N_EPISODES)]
            return [d.result() for d in done], backend.tally
        finally:
            await backend.aclose()

    completed, tally = benchmark.pedantic(lambda: asyncio.run(episodes()), rounds=1, iterations=1)
    assert len(completed) == N_EPISODES and all(e.ok and sum(e.mask) > 0 for e in completed)
    per = {"verifiers_ms": tally.harness_s, "orch_route_ms": tally.route_s, "orch_ms": tally.orch_s}
    benchmark.extra_info.update({k: round(1000 * v / tally.episodes, 3) for k, v in per.items()})
    benchmark.extra_info.update(episodes=tally.episodes, model_calls=tally.calls, at_once=EPISODES_AT_ONCE)
    print("verifiers bench:", benchmark.extra_info)

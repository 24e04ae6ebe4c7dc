"""orch's per-episode overhead on top of verifiers' own, on one run of the `verifiers` env.

The tiny model on a real vLLM-CPU server (started by orch's launcher with --enable-scale-out);
the `orch_reverse_text` taskset (one turn) played through the `openai` backend
(``EndpointsBackend``, which hands each request to the env with its client), N_EPISODES episodes,
EPISODES_AT_ONCE at a time. Per episode, reported separately:

* ``verifiers_ms``: inside verifiers' `run_slot` (the harness subprocess, its model calls, scoring);
* ``orch_route_ms``: orch's routing of those model calls beyond their HTTP exchange with vLLM
  (endpoint choice, version check, JSON, the logprob shape) — part of ``verifiers_ms``;
* ``orch_ms``: the rest of the episode as the backend's caller sees it, orch's own (the backend's
  dispatch, the task draw, branch to sample, versions).

Only broken invariants fail it (every episode ok, its sample non-empty), never a ratio.
Run: ``.venv/bin/python -m pytest bench/test_verifiers_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("verifiers.v1")

from orchestrator.contracts import RolloutRequest  # noqa: E402
from orchestrator.inference.client import InferenceClient  # noqa: E402
from orchestrator.inference.endpoints_backend import EndpointsBackend  # noqa: E402
from orchestrator.verifiers.component import VerifiersConfig  # noqa: E402
from orchestrator.verifiers.env import VerifiersEnv  # noqa: E402
from tests.inference.vllm_util import launched, needs_vllm, publish_full, tiny_model  # noqa: E402
from tests.verifiers.util import EXAMPLES, GENERATE_ARGS  # noqa: E402

pytestmark = needs_vllm
N_EPISODES = 8
EPISODES_AT_ONCE = 2
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = tiny_model()
    with launched(model, tmp_path_factory.mktemp("logs"), "vllm_reload", extra_args=GENERATE_ARGS) as launcher:
        yield model, launcher.urls[0]


def test_orch_overhead_per_verifiers_episode(benchmark, served, tmp_path):
    model, url = served
    section = VerifiersConfig(taskset="orch_reverse_text", path=[str(EXAMPLES / "verifiers_tasksets")], max_turns=1)
    publish_full(tmp_path, 0, model)  # the version the backend loads before any episode
    env = VerifiersEnv(
        section, seed=0, temperature=1.0, max_tokens=MAX_TOKENS, model=str(model), renderer_model=str(model)
    )

    async def episodes():
        client = InferenceClient([url], weight_sync="vllm_reload")
        backend = EndpointsBackend(
            tmp_path, {"verifiers": env}, client, temperature=1.0, max_new_tokens=MAX_TOKENS, seed=0, load_timeout_s=120
        )
        async with env.serving():
            try:
                await backend.load(0)
                gate = asyncio.Semaphore(EPISODES_AT_ONCE)

                async def one(i: int):
                    async with gate:
                        began = time.perf_counter()
                        done = await backend(RolloutRequest(i, i // 2, "verifiers", i // 2, 0, 0))
                        return done, time.perf_counter() - began

                async with asyncio.TaskGroup() as tg:
                    runs = [tg.create_task(one(i)) for i in range(N_EPISODES)]
                return [r.result() for r in runs]
            finally:
                await backend.aclose()

    results = benchmark.pedantic(lambda: asyncio.run(episodes()), rounds=1, iterations=1)
    completed = [done for done, _ in results]
    assert len(completed) == N_EPISODES and all(e.ok and sum(e.mask) > 0 for e in completed)
    tally = env.tally
    per_episode_s = sum(wall for _, wall in results) / tally.episodes
    benchmark.extra_info.update(
        verifiers_ms=round(1000 * tally.harness_s / tally.episodes, 3),
        orch_route_ms=round(1000 * tally.route_s / tally.episodes, 3),
        orch_ms=round(1000 * (per_episode_s - tally.harness_s / tally.episodes), 3),
        episodes=tally.episodes,
        model_calls=tally.calls,
        at_once=EPISODES_AT_ONCE,
    )
    print("verifiers bench:", benchmark.extra_info)

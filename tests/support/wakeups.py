"""Measurement helpers for tests and benchmarks of consumer wake-ups.

:class:`ResumptionCounter` wraps a consumer coroutine so that every time the event loop resumes
it (each ``send``/``throw`` after the first start) is counted. The consumer itself uses only the public
stream API; a stream that wakes consumers spuriously (e.g. a shared event) shows up as extra
resumptions even though every ``wait_ready`` eventually returns with a single outcome to take.
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol

from orchestrator.collection.collect import ExampleFeed, RolloutStream, run_examples


class ReadyStream(Protocol):
    """What a consumer of rollout outcomes uses: ``RolloutStream``'s consumption API."""

    async def wait_ready(self, timeout: float | None = None) -> bool: ...

    def take_ready(self) -> list[Any]: ...


class ResumptionCounter:
    """Shared tally of consumer resumptions across every coroutine wrapped with :meth:`wrap`."""

    __slots__ = ("resumptions", "starts")

    def __init__(self) -> None:
        self.starts = 0
        self.resumptions = 0

    def wrap(self, coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
        return _CountingCoroutine(coro, self)


class _CountingCoroutine(collections.abc.Coroutine):
    __slots__ = ("_coro", "_counter", "_started")

    def __init__(self, coro: Coroutine[Any, Any, Any], counter: ResumptionCounter) -> None:
        self._coro = coro
        self._counter = counter
        self._started = False

    def _tick(self) -> None:
        if self._started:
            self._counter.resumptions += 1
        else:
            self._started = True
            self._counter.starts += 1

    def send(self, value: Any) -> Any:
        self._tick()
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        self._tick()
        return self._coro.throw(*args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self._coro.__await__()


def rollouts_of(examples: Iterable[Any], fn: Callable[[Any], Awaitable[Any]], **options: Any) -> RolloutStream:
    """``run_examples`` over a feed given every example up front, then closed: the stream is done
    once each outcome has been delivered."""
    feed: ExampleFeed[Any] = ExampleFeed(examples)
    feed.close()
    return run_examples(feed, fn, **options)


class SharedEventStream:
    """Baseline: completions append to a deque and set one shared event that wakes every parked
    consumer, which re-checks and re-parks."""

    def __init__(self, examples: Iterable[Any], fn: Callable[[Any], Awaitable[Any]]) -> None:
        self._ready: deque[Any] = deque()
        self._event = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._run(fn, x)) for x in examples]
        self._left = len(self._tasks)

    async def _run(self, fn: Callable[[Any], Awaitable[Any]], example: Any) -> None:
        self._ready.append(await fn(example))
        self._event.set()

    async def wait_ready(self, timeout: float | None = None) -> bool:  # the workload waits unbounded
        while not self._ready:
            if self._left == 0:
                return False
            self._event.clear()
            await self._event.wait()
        return True

    def take_ready(self) -> list[Any]:
        taken = list(self._ready)
        self._ready.clear()
        self._left -= len(taken)
        if self._left == 0:
            self._event.set()  # release consumers waiting for the end
        return taken


async def settle(rounds: int = 6) -> None:
    """Let every ready callback and task step run (a few loop iterations)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def arrival_workload(
    make_stream: Callable[[Iterable[int], Callable[[int], Awaitable[int]]], ReadyStream],
    n: int = 1024,
    consumers: int | None = None,
    *,
    looping: bool = False,
    timeout: float = 60.0,
) -> dict[str, int]:
    """``n`` rollouts finishing one at a time, each only after every consumer has parked again.

    ``make_stream(examples, fn)`` builds the stream under test (``run_examples`` over a closed
    feed, or a baseline). ``consumers`` parked consumers (default ``n``): eager ones each wait
    once and take the outcome they were woken for; ``looping=True`` ones wait and take until the
    stream ends. Returns the number of consumer resumptions (counted by
    :class:`ResumptionCounter`), outcomes delivered and the number of distinct keys delivered.
    """
    loop = asyncio.get_running_loop()
    consumers = n if consumers is None else consumers
    gates: list[asyncio.Future[int]] = [loop.create_future() for _ in range(n)]

    async def fn(i: int) -> int:
        return await gates[i]

    stream = make_stream(range(n), fn)
    counter = ResumptionCounter()
    delivered: list[Any] = []

    async def eager() -> None:
        if await stream.wait_ready(None):
            delivered.extend(stream.take_ready())

    async def loop_consumer() -> None:
        while await stream.wait_ready(None):
            delivered.extend(stream.take_ready())

    make = loop_consumer if looping else eager
    tasks = [asyncio.create_task(counter.wrap(make())) for _ in range(consumers)]
    await settle()
    deadline = loop.time() + timeout
    for i in range(n):
        gates[i].set_result(i)
        while len(delivered) <= i:
            if loop.time() > deadline:
                raise TimeoutError(f"arrival workload: outcome {i} never delivered")
            await asyncio.sleep(0)
        await settle()
    await asyncio.wait_for(asyncio.gather(*tasks), max(0.1, deadline - loop.time()))
    keys = {getattr(o, "key", o) for o in delivered}
    return {"resumptions": counter.resumptions, "delivered": len(delivered), "distinct": len(keys)}

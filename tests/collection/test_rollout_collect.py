"""run_examples / RolloutStream: delivery, wake-ups, cancellation, drain, retrieval, lifetime."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import pytest

from orchestrator.collection.collect import ExampleFeed, Outcome, RolloutStream, run_examples
from tests.support.wakeups import SharedEventStream, arrival_workload, rollouts_of, settle


async def _gated(n: int):
    """fn whose example i finishes only when gates[i] is released."""
    loop = asyncio.get_running_loop()
    gates = [loop.create_future() for _ in range(n)]
    cancelled: list[int] = []

    async def fn(i: int) -> int:
        try:
            return await gates[i]
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    return gates, cancelled, fn


async def _all_outcomes(stream: RolloutStream) -> list[Outcome]:
    """Wait and take until the stream is done."""
    got: list[Outcome] = []
    while await stream.wait_ready(None):
        got.extend(stream.take_ready())
    return got


# --------------------------------------------------------------------------- basics


def test_a_feed_delivers_everything(arun):
    async def fn(x: int) -> int:
        await asyncio.sleep(0.001 * (x % 3))
        return x * 10

    async def main():
        got = await _all_outcomes(rollouts_of(range(30), fn))
        assert sorted(o.key for o in got) == list(range(30))
        assert all(o.ok and o.result == o.example * 10 and o.started <= o.finished for o in got)

        got = await _all_outcomes(rollouts_of(range(30), fn, max_concurrency=4))
        assert sorted((o.key, o.result) for o in got) == [(i, i * 10) for i in range(30)]

        feed: ExampleFeed[int] = ExampleFeed([100])
        stream = run_examples(feed, fn)
        keys = [feed.put(i) for i in range(5)] + [feed.put(7, key="seven")]
        assert keys == [1, 2, 3, 4, 5, "seven"]
        feed.close()
        with pytest.raises(RuntimeError):
            feed.put(1)
        got = {o.key: o.result for o in await _all_outcomes(stream)}
        assert got == {0: 1000, 1: 0, 2: 10, 3: 20, 4: 30, 5: 40, "seven": 70}

    arun(main)


def test_max_concurrency_is_respected(arun):
    async def main():
        running = peak = 0

        async def fn(x: int) -> int:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001)
            running -= 1
            return x

        stream = rollouts_of(range(50), fn, max_concurrency=3)
        assert stream.in_flight == 3 and stream.queued == 47
        got = await _all_outcomes(stream)
        assert len(got) == 50 and peak == 3

    arun(main)


def test_failures_are_outcomes(arun):
    async def fn(x: int) -> int:
        await asyncio.sleep(0)
        if x % 4 == 0:
            raise ValueError(f"bad {x}")
        return x

    async def main():
        got = await _all_outcomes(rollouts_of(range(12), fn))
        failed = sorted(o.key for o in got if not o.ok)
        assert failed == [0, 4, 8]
        bad = next(o for o in got if o.key == 4)
        assert isinstance(bad.exception, ValueError) and bad.result is None
        assert str(bad.exception) == "bad 4"

    arun(main)


# --------------------------------------------------------------------------- wake-ups


def test_1024_arrivals_eager_consumers_exactly_1024_resumptions(arun):
    """Spec regression: 1,024 outcomes arriving one by one, 1,024 parked eager consumers."""
    stats = arun(lambda: arrival_workload(rollouts_of, n=1024))
    assert stats == {"resumptions": 1024, "delivered": 1024, "distinct": 1024}


def test_1024_arrivals_8_looping_consumers(arun):
    """8 consumers waiting and taking in a loop: one resumption per outcome, plus one each for
    the 7 consumers still parked when the last outcome is taken (to tell them the stream is done)."""
    stats = arun(lambda: arrival_workload(rollouts_of, n=1024, consumers=8, looping=True))
    assert stats == {"resumptions": 1024 + 7, "delivered": 1024, "distinct": 1024}


def test_resumption_counter_detects_a_shared_event(arun):
    """The measurement can fail: a shared-event stream wakes every parked consumer per arrival."""
    stats = arun(lambda: arrival_workload(SharedEventStream, n=64))
    assert stats["delivered"] == 64
    assert stats["resumptions"] == 64 * 65 // 2  # 2,080, not 64


def test_cancelled_notified_consumer_passes_the_notification_on(arun):
    async def main():
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        waiters: dict[str, asyncio.Task] = {}

        async def fn(x: int) -> int:
            await gate
            # Runs in the same step that completes the rollout and notifies waiter "a": the
            # cancellation lands after the notification, before "a" can resume.
            loop.call_soon(waiters["a"].cancel)
            return x

        feed: ExampleFeed[int] = ExampleFeed()
        stream = run_examples(feed, fn)
        waiters["a"] = asyncio.create_task(stream.wait_ready(10))
        await settle()
        waiters["b"] = asyncio.create_task(stream.wait_ready(10))
        await settle()
        feed.put(42)
        await settle()
        gate.set_result(None)
        assert await asyncio.wait_for(waiters["b"], 2) is True
        assert waiters["a"].cancelled()
        assert [o.result for o in stream.take_ready()] == [42]
        feed.close()
        assert stream.done and await stream.wait_ready(1) is False

    arun(main)


def test_drain_wakes_every_parked_consumer(arun):
    async def main():
        gates, cancelled, fn = await _gated(4)
        stream = rollouts_of(range(4), fn)
        parked = [asyncio.create_task(stream.wait_ready()) for _ in range(5)]
        await settle()
        assert not any(t.done() for t in parked)
        kept = await asyncio.wait_for(stream.aclose_and_drain(), 2)
        assert kept == 0
        results = await asyncio.wait_for(asyncio.gather(*parked), 2)
        assert results == [False] * 5  # every consumer woken, the stream done
        assert sorted(cancelled) == [0, 1, 2, 3] and stream.in_flight == 0 and stream.done

    arun(main)


# --------------------------------------------------------------------------- drain / close


def test_completed_backlog_is_delivered_after_drain(arun):
    async def main():
        gates, cancelled, fn = await _gated(14)
        feed: ExampleFeed[int] = ExampleFeed()
        stream = run_examples(feed, fn, max_concurrency=8)
        for i in range(14):
            feed.put(i)
        assert stream.in_flight == 8 and stream.queued == 6
        for i in (0, 2, 4):
            gates[i].set_result(i * 100)
        gates[6].set_exception(RuntimeError("grader down"))
        await settle()
        assert len(stream) == 4 and stream.in_flight == 8 and stream.queued == 2

        kept = await asyncio.wait_for(stream.aclose_and_drain(), 2)
        assert kept == 4 and not stream.admitting
        with pytest.raises(RuntimeError):
            feed.put(99)
        # unfinished work cancelled; 12 and 13 never started
        assert sorted(cancelled) == [1, 3, 5, 7, 8, 9, 10, 11]
        # Completed (successes and the failure) come out exactly once, then the stream is done.
        assert await stream.wait_ready(0) is True
        got = {o.key: (o.result if o.ok else repr(o.exception)) for o in stream.take_ready()}
        assert got == {0: 0, 2: 200, 4: 400, 6: "RuntimeError('grader down')"}
        assert stream.take_ready() == [] and stream.done and await stream.wait_ready(1) is False

    arun(main)


def test_drain_stops_admission_before_suspending(arun):
    async def main():
        started: list[int] = []

        async def fn(x: int) -> int:
            started.append(x)
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0)  # unwinding takes steps: a freed slot could admit more
            return x

        stream = rollouts_of(range(100), fn, max_concurrency=2)
        await settle()
        assert started == [0, 1]
        drain = asyncio.create_task(stream.aclose_and_drain())
        await asyncio.sleep(0)  # exactly the drain's first step ran; it is now suspended
        assert not drain.done()
        assert not stream.admitting and stream.queued == 0 and stream.in_flight == 0
        await drain
        await settle()
        assert started == [0, 1]  # nothing was admitted while the cancelled tasks unwound
        assert stream.take_ready() == [] and stream.done

    arun(main)


def test_aclose_with_unfinished_work_returns_promptly_and_cancels(arun):
    async def main():
        cancelled: list[int] = []

        async def fn(x: int) -> int:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(x)
                raise
            return x

        async def instant(x: int) -> int:
            return x

        stream = rollouts_of(range(200), fn, max_concurrency=50)
        parked = asyncio.create_task(stream.wait_ready())
        await settle()
        await stream.aclose()  # the work sleeps an hour: returning at all means it was cancelled
        assert len(cancelled) == 50 and stream.in_flight == 0 and stream.queued == 0
        assert await asyncio.wait_for(parked, 1) is False
        assert stream.take_ready() == [] and await stream.wait_ready(0.01) is False
        await stream.aclose()  # idempotent

        # aclose discards the undelivered backlog (drain is the one that keeps it).
        stream = rollouts_of(range(5), instant)
        await settle()
        assert len(stream) == 5
        await stream.aclose()
        assert len(stream) == 0 and stream.take_ready() == [] and stream.done

        # async with = aclose on exit
        async with rollouts_of(range(3), fn) as s:
            await settle()
            assert s.in_flight == 3
        assert s.in_flight == 0

    arun(main)


def test_aclose_timeout_names_stuck_tasks(arun):
    async def main():
        release = asyncio.Event()

        async def stubborn(x: int) -> int:
            while True:
                try:
                    await release.wait()
                    return x
                except asyncio.CancelledError:
                    if release.is_set():
                        raise
                    continue  # ignores cancellation until released

        stream = rollouts_of(range(2), stubborn)
        await settle()
        with pytest.raises(TimeoutError, match=r"^rollout stream close: 2 rollout task\(s\) still running 0.05s after"):
            await stream.aclose(timeout=0.05)
        release.set()
        await stream.aclose(timeout=2)

    arun(main)


def test_no_unretrieved_exceptions_anywhere(arun):
    """Failures, cancellations and a close with failing unconsumed outcomes: the loop's exception
    handler (installed by ``arun``) must see nothing."""

    async def main():
        async def fn(x: int) -> int:
            await asyncio.sleep(0.001 * (x % 3))
            if x % 2:
                raise ValueError(x)
            if x % 5 == 0:
                await asyncio.sleep(3600)
            return x

        stream = rollouts_of(range(40), fn)
        seen = 0
        while seen < 5 and await stream.wait_ready(None):
            seen += len(stream.take_ready())
        await stream.aclose()  # failures never consumed, sleepers cancelled

        stream = rollouts_of(range(40), fn)
        await asyncio.sleep(0.02)
        await stream.aclose_and_drain()
        failures = [o for o in stream.take_ready() if not o.ok]
        assert failures and all(isinstance(o.exception, ValueError) for o in failures)

    arun(main)


def test_fn_raising_cancelled_error_itself_is_an_outcome(arun):
    async def fn(x: int) -> int:
        await asyncio.sleep(0)
        raise asyncio.CancelledError("fn gave up")

    async def main():
        got = await _all_outcomes(rollouts_of(range(3), fn))
        assert len(got) == 3 and all(isinstance(o.exception, asyncio.CancelledError) for o in got)

    arun(main)


# --------------------------------------------------------------------------- cancel(key)


def test_cancel_one_key(arun):
    async def main():
        gates, cancelled, fn = await _gated(5)
        feed: ExampleFeed[int] = ExampleFeed()
        stream = run_examples(feed, fn, max_concurrency=2)
        for i in range(5):
            feed.put(i, key=f"ep{i}")
        await settle()
        assert stream.in_flight == 2 and stream.queued == 3
        with pytest.raises(ValueError, match="duplicate"):
            feed.put(0, key="ep3")
        assert stream.cancel("ep3") is True  # queued: never starts
        assert stream.cancel("ep0") is True  # running: cancelled, its slot goes to ep2
        assert stream.cancel("ep2") is True  # started but not yet run a step: fn never runs
        assert stream.cancel("nope") is False
        assert stream.in_flight == 2 and stream.queued == 0  # ep1, ep4
        gates[1].set_result(1)
        await settle()
        assert stream.cancel("ep1") is False  # finished: delivered normally
        assert cancelled == [0] and len(stream._tasks) == stream.in_flight == 1  # (internal) nothing unwinding
        gates[4].set_result(4)
        feed.close()
        got = sorted(o.key for o in await _all_outcomes(stream))
        assert got == ["ep1", "ep4"]  # cancelled examples are never delivered
        assert stream.done

    arun(main)


# --------------------------------------------------------------------------- batch API


def test_take_ready_and_wait_ready(arun):
    async def main():
        gates, _, fn = await _gated(6)
        stream = rollouts_of(range(6), fn)
        assert stream.take_ready() == []
        assert await stream.wait_ready(0.05) is False  # nothing ready: it times out and says so
        for i in range(3):
            gates[i].set_result(i)
        assert await stream.wait_ready(1) is True
        await settle()
        batch = stream.take_ready()
        assert [o.key for o in batch] == [0, 1, 2] and len(stream) == 0
        assert stream.in_flight == 3
        # a timed-out wait_ready leaves no stale waiter behind: the next arrival still notifies
        assert await stream.wait_ready(0.01) is False
        waiter = asyncio.create_task(stream.wait_ready(5))
        await settle()
        gates[3].set_result(3)
        assert await asyncio.wait_for(waiter, 1) is True
        gates[4].set_result(4)
        gates[5].set_result(5)
        await settle()
        assert sorted(o.key for o in stream.take_ready()) == [3, 4, 5]
        assert stream.done and await stream.wait_ready(1) is False

    arun(main)


def test_each_outcome_exactly_once_under_concurrency(arun):
    async def main():
        rng = random.Random(1234)
        delays = [rng.choice([0, 0, 0.0005, 0.001, 0.002]) for _ in range(3000)]

        async def fn(i: int) -> int:
            if delays[i]:
                await asyncio.sleep(delays[i])
            if i % 97 == 0:
                raise RuntimeError(i)
            return i

        feed: ExampleFeed[int] = ExampleFeed()
        stream = run_examples(feed, fn, max_concurrency=300)
        received: list[Outcome] = []

        async def polling():  # short bounded waits: most time out and park again
            while not stream.done:
                if await stream.wait_ready(0.001):
                    received.extend(stream.take_ready())
                if rng.random() < 0.1:
                    await asyncio.sleep(0)

        async def batching():
            while await stream.wait_ready(5):
                received.extend(stream.take_ready())
                await asyncio.sleep(0)

        async def producer():
            for i in range(3000):
                feed.put(i)
                if i % 50 == 0:
                    await asyncio.sleep(0.001)
            feed.close()

        consumers = [asyncio.create_task(polling()) for _ in range(5)]
        consumers += [asyncio.create_task(batching()) for _ in range(2)]
        await producer()
        await asyncio.wait_for(asyncio.gather(*consumers), 20)
        keys = [o.key for o in received]
        assert len(keys) == 3000 and set(keys) == set(range(3000))
        assert sum(1 for o in received if not o.ok) == len(range(0, 3000, 97))

    arun(main)


# --------------------------------------------------------------------------- lifetime


class Payload:
    def __init__(self, i: int) -> None:
        self.i = i
        self.blob = bytearray(1000)


def test_consumed_payloads_are_released(arun):
    refs: list[weakref.ref] = []

    async def fn(i: int) -> Payload:
        await asyncio.sleep(0)
        p = Payload(i)
        refs.append(weakref.ref(p))
        return p

    async def main():
        stream = rollouts_of(range(50), fn)
        n = 0
        while await stream.wait_ready(None):
            for outcome in stream.take_ready():
                assert isinstance(outcome.result, Payload)
                n += 1
        del outcome
        assert n == 50
        gc.collect()
        assert sum(r() is not None for r in refs) == 0

        # drain path: backlog taken, stream closed, nothing retained
        refs.clear()
        stream = rollouts_of(range(20), fn)
        await settle()
        await stream.aclose_and_drain()
        batch = stream.take_ready()
        assert len(batch) == 20
        del batch
        await stream.aclose()
        gc.collect()
        assert sum(r() is not None for r in refs) == 0
        # the stream object itself is still alive here: it is the stream that must not retain
        assert stream.done

    arun(main)


def test_stream_retains_nothing_after_delivery_while_alive(arun):
    """Outcome objects themselves are not kept: weakrefs to delivered outcomes die at once."""

    async def fn(i: int) -> int:
        return i

    async def main():
        stream = rollouts_of(range(10), fn)
        outcome_refs = []
        while await stream.wait_ready(None):
            for o in stream.take_ready():
                outcome_refs.append(weakref.ref(o))
        del o
        assert all(r() is None for r in outcome_refs)  # refcounting alone frees them

    arun(main)

"""Rollout collection: run an async ``fn`` over examples and hand out the outcomes as they finish.

``run_examples(feed, fn)`` starts one task per example the :class:`ExampleFeed` is given (at most
``max_concurrency`` at once) and returns a :class:`RolloutStream`, from which consumers take the
:class:`Outcome` of each in completion order: ``wait_ready`` parks until one is ready,
``take_ready`` takes every one ready.

Delivery guarantees (they hold for any number of concurrent consumers):

* **One notification per finished rollout.** A finished rollout appends its outcome to a ready
  queue and wakes at most *one* parked consumer (FIFO). There is no shared event that wakes every
  consumer, so N outcomes arriving one by one cost N consumer resumptions, not O(N x consumers).
* **Exactly once.** Every outcome is handed to exactly one consumer (``take_ready``). A consumer
  cancelled after being notified but before it resumed passes its notification on to the next
  parked consumer; the outcome stays queued.
* **Failures are outcomes.** An exception raised by ``fn`` is stored in ``Outcome.exception``; it is
  never raised out of the stream and never left unretrieved on a task.
* **No retention.** Once an outcome is delivered the stream holds no reference to it (nor to its
  example or result).

Lifecycle (the stream's tasks have one owner, its ``orchestrator.tasks.TaskOwner``; nothing is
orphaned):

* the stream is :attr:`RolloutStream.done` once its feed is ``close()``-d and every outcome has
  been delivered;
* :meth:`RolloutStream.aclose` cancels everything and discards undelivered outcomes;
* :meth:`RolloutStream.aclose_and_drain` cancels unfinished work but keeps the completed,
  unconsumed outcomes for the consumers, then the stream is done;
* :meth:`RolloutStream.cancel` withdraws one example; its outcome is never delivered.

The owner must either consume the stream to its end or call ``aclose``/``aclose_and_drain``
(``async with`` does it): a stream dropped while rollouts are still running does not stop them.

Everything here runs on one event loop; none of it is thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from orchestrator.tasks import StillRunning, TaskOwner

__all__ = ["ExampleFeed", "Outcome", "RolloutStream", "run_examples"]

E = TypeVar("E")
R = TypeVar("R")

_monotonic = time.monotonic


@dataclass(slots=True, eq=False, weakref_slot=True)
class Outcome(Generic[E, R]):
    """The result of one rollout: ``fn(example)`` returned ``result`` or raised ``exception``.

    ``key`` identifies the example within its stream: what :meth:`ExampleFeed.put` returned.
    ``started``/``finished`` are ``time.monotonic()`` readings taken when the rollout task began
    running and when ``fn`` returned or raised.
    """

    key: Hashable
    example: E
    result: R | None
    exception: BaseException | None
    started: float
    finished: float

    @property
    def ok(self) -> bool:
        return self.exception is None

    @property
    def duration(self) -> float:
        return self.finished - self.started


class ExampleFeed(Generic[E]):
    """An open-ended source: the owner submits examples over time, then closes the feed.

    ``put`` never blocks and is unbounded (``max_concurrency`` limits what *runs*, not what is
    queued). A feed drives at most one stream. Examples put before the feed is handed to
    :func:`run_examples` are buffered.
    """

    __slots__ = ("_buffer", "_closed", "_counter", "_stream")

    def __init__(self, examples: Iterable[E] = ()) -> None:
        self._stream: RolloutStream[E, Any] | None = None
        self._buffer: deque[tuple[Hashable, E]] | None = deque()
        self._closed = False
        self._counter = 0
        for example in examples:
            self.put(example)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, example: E, *, key: Hashable | None = None) -> Hashable:
        """Submit ``example``; returns its key (``key`` if given, else the 0-based submission index).

        Raises ``RuntimeError`` after :meth:`close` or once the stream stopped admitting
        (``aclose``/``aclose_and_drain``), and ``ValueError`` if ``key`` is already queued or running
        in this stream (keys must be unique among unfinished examples).
        """
        if self._closed:
            raise RuntimeError("ExampleFeed.put() after close()")
        if key is None:
            key = self._counter
        stream = self._stream
        if stream is None:
            assert self._buffer is not None
            self._buffer.append((key, example))
        else:
            stream._submit(key, example)
        self._counter += 1
        return key

    def close(self) -> None:
        """No more examples: the stream ends once everything submitted has been delivered."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream._no_more_examples()

    def _bind(self, stream: RolloutStream[E, Any]) -> None:
        if self._stream is not None:
            raise RuntimeError("an ExampleFeed can drive only one stream")
        self._stream = stream
        buffered, self._buffer = self._buffer, None
        assert buffered is not None
        for key, example in buffered:
            stream._submit(key, example)
        if self._closed:
            stream._no_more_examples()


class _Job:
    """A running example: the stream's bookkeeping; its task belongs to the stream's TaskOwner."""

    __slots__ = ("cancelled", "example", "key")

    def __init__(self, key: Hashable, example: Any) -> None:
        self.key = key
        self.example = example
        self.cancelled = False


_OPEN, _DRAINING, _CLOSED = 0, 1, 2


class RolloutStream(Generic[E, R]):
    """The outcomes of a feed's rollouts; see the module docstring for the guarantees.

    Consumption (each outcome goes to exactly one caller):

    * :meth:`wait_ready`: bounded wait until at least one outcome is ready (consumes nothing);
    * :meth:`take_ready`: everything completed right now, without waiting.

    Counts: ``len(stream)`` = completed outcomes not yet delivered; :attr:`in_flight` = rollouts
    running; :attr:`queued` = submitted examples waiting for a ``max_concurrency`` slot.

    Also an async context manager: ``async with run_examples(...) as stream`` calls
    :meth:`aclose` on exit.
    """

    def __init__(
        self,
        fn: Callable[[E], Awaitable[R]],
        *,
        max_concurrency: int | None = None,
    ) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
        self._loop = asyncio.get_running_loop()
        self._fn = fn
        self._limit = max_concurrency
        self._state = _OPEN
        self._ready: deque[Outcome[E, R]] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._running: dict[Hashable, _Job] = {}
        # Every rollout task, those cancelled and still unwinding included; keyed by the example's
        # key while it runs. A rollout's failure is an outcome: a task that fails is a bug of the
        # stream's, reported on the event loop's handler.
        self._tasks = TaskOwner("rollout stream")
        # Submitted but not started (max_concurrency); order kept by _pending_order.
        self._pending: dict[Hashable, E] = {}
        self._pending_order: deque[Hashable] = deque()
        self._feed_closed = False

    # ------------------------------------------------------------------ counts
    def __len__(self) -> int:
        """Completed outcomes waiting to be delivered."""
        return len(self._ready)

    @property
    def in_flight(self) -> int:
        """Rollouts started and not finished (cancelled ones no longer count)."""
        return len(self._running)

    @property
    def queued(self) -> int:
        """Submitted examples waiting for a concurrency slot."""
        return len(self._pending)

    @property
    def admitting(self) -> bool:
        """False once ``aclose``/``aclose_and_drain`` has been called."""
        return self._state == _OPEN

    @property
    def done(self) -> bool:
        """True when no outcome will ever be delivered again."""
        return not self._ready and self._nothing_left()

    # ------------------------------------------------------------------ admission
    def _nothing_left(self) -> bool:
        if self._state != _OPEN:
            return True
        return self._feed_closed and not self._running and not self._pending

    def _has_room(self) -> bool:
        return self._limit is None or len(self._running) < self._limit

    def _submit(self, key: Hashable, example: E) -> None:
        if self._state != _OPEN:
            raise RuntimeError("rollout stream is closed to new examples (aclose/aclose_and_drain called)")
        if key in self._running or key in self._pending:
            raise ValueError(f"duplicate rollout key {key!r}: that example is still queued or running")
        if self._pending or not self._has_room():
            self._pending[key] = example
            self._pending_order.append(key)
            if self._has_room():
                self._fill()
        else:
            self._start(key, example)

    def _start(self, key: Hashable, example: E) -> None:
        job = _Job(key, example)
        self._running[key] = job
        self._tasks.start(self._run(job), key=key)

    def _fill(self) -> None:
        """Start queued examples while there is room (called when a slot frees up)."""
        while self._state == _OPEN and self._has_room() and self._pending:
            key = self._pending_order.popleft()
            if key in self._pending:  # else withdrawn by cancel(key)
                self._start(key, self._pending.pop(key))

    def _no_more_examples(self) -> None:
        self._feed_closed = True
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        if not self._ready and self._nothing_left():
            self._wake_all()

    # ------------------------------------------------------------------ running
    async def _run(self, job: _Job) -> None:
        started = _monotonic()
        try:
            result = await self._fn(job.example)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if job.cancelled or (task is not None and task.cancelling()):
                # Withdrawn by cancel()/close, or the task itself was cancelled from outside (loop
                # shutdown): no outcome, propagate the cancellation.
                self._finish(job, None)
                raise
            # fn raised CancelledError on its own (its task was not cancelled): a failure outcome.
            outcome = Outcome(job.key, job.example, None, exc, started, _monotonic())
        except Exception as exc:
            outcome = Outcome(job.key, job.example, None, exc, started, _monotonic())
        except BaseException:  # KeyboardInterrupt/SystemExit: not an outcome, let it propagate
            self._finish(job, None)
            raise
        else:
            outcome = Outcome(job.key, job.example, result, None, started, _monotonic())
            del result
        self._finish(job, outcome)

    def _finish(self, job: _Job, outcome: Outcome[E, R] | None) -> None:
        job.example = None
        if job.cancelled:  # withdrawn: cancel()/close already did the bookkeeping
            return
        if self._running.get(job.key) is job:
            del self._running[job.key]
        if outcome is not None:
            self._ready.append(outcome)
            self._wake_one()
        if self._state == _OPEN:
            self._fill()
            if not self._ready and self._nothing_left():
                self._wake_all()

    # ------------------------------------------------------------------ notification
    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _park(self, timeout: float | None = None) -> None:
        """Wait for one notification (or ``timeout``). Cancellation-safe: a notification received
        by a consumer cancelled before it could resume is passed on to the next parked consumer."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._waiters.append(fut)
        handle = self._loop.call_later(timeout, _expire, fut) if timeout is not None else None
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is not _TIMED_OUT:
                if self._ready:
                    self._wake_one()
            else:
                _discard(self._waiters, fut)
            raise
        finally:
            if handle is not None:
                handle.cancel()
        if fut.result() is _TIMED_OUT:
            _discard(self._waiters, fut)

    def _after_take(self) -> None:
        # The last outcome was just taken: release consumers parked for the end of the stream.
        if self._waiters and not self._ready and self._nothing_left():
            self._wake_all()

    # ------------------------------------------------------------------ consumption
    def take_ready(self) -> list[Outcome[E, R]]:
        """Every outcome completed so far, in completion order, without waiting (maybe ``[]``)."""
        if not self._ready:
            return []
        out = list(self._ready)
        self._ready.clear()
        self._after_take()
        return out

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until at least one outcome is ready, at most ``timeout`` seconds; consumes nothing.

        Returns True if an outcome is ready (take it with :meth:`take_ready`), False on timeout or
        when the stream is :attr:`done`. Cancellation-safe: if cancelled after the notification,
        the notification goes to the next parked consumer.
        """
        deadline = None if timeout is None else self._loop.time() + timeout
        while True:
            if self._ready:
                return True
            if self._nothing_left():
                return False
            remaining = None if deadline is None else deadline - self._loop.time()
            if remaining is not None and remaining <= 0:
                return False
            # Woken without an outcome left (another consumer took it): park again until deadline.
            await self._park(remaining)

    # ------------------------------------------------------------------ control
    def cancel(self, key: Hashable) -> bool:
        """Withdraw one example. Its outcome is then **never delivered** (not even as cancelled).

        Returns True if the example was queued (it will never start) or running (its task is
        cancelled now; :meth:`aclose`/:meth:`aclose_and_drain` await it). Returns False if the key
        is unknown or the rollout already finished (its outcome is, or was, delivered normally).
        The caller accounts for the cancellation itself.
        """
        if key in self._pending:
            del self._pending[key]
            if not self._pending:
                self._pending_order.clear()  # drop the withdrawn keys' stale order entries
            self._maybe_finished()
            return True
        job = self._running.pop(key, None)
        if job is None:
            return False
        self._withdraw(job)
        if self._state == _OPEN:
            self._fill()
        self._maybe_finished()
        return True

    def _withdraw(self, job: _Job) -> None:
        job.cancelled = True
        job.example = None
        # Its task stays with the TaskOwner until it has unwound: a close waits for it.
        self._tasks.cancel(job.key)

    def _stop_admission(self) -> None:
        """Stop admitting, withdraw every queued and running example."""
        self._state = max(self._state, _DRAINING)
        self._pending.clear()
        self._pending_order.clear()
        for job in self._running.values():
            self._withdraw(job)
        self._running.clear()

    async def aclose(self, timeout: float | None = None) -> None:
        """Cancel every unfinished rollout, discard undelivered outcomes; the stream is done.

        What it waits for: the rollout tasks *in this process* to finish unwinding their
        cancellation; every task's exception is retrieved. It does *not* wait for, or confirm, any
        server-side cleanup: for HTTP rollouts, cancelling the request closes the connection and
        the server's disconnect middleware cancels its handler, but that happens on the server
        after ``aclose()`` may already have returned.

        Parked consumers are woken (``wait_ready`` returns False). Idempotent. With ``timeout``,
        raises ``TimeoutError`` if some task ignores its cancellation for that long (those tasks
        still have their exceptions retrieved when they finish).
        """
        self._stop_admission()
        self._state = _CLOSED
        self._ready.clear()
        self._wake_all()
        await self._await_tasks(timeout)

    async def aclose_and_drain(self, timeout: float | None = None) -> int:
        """Stop admission, cancel unfinished work, keep the completed backlog for the consumers.

        Admission stops *before* this coroutine first suspends: nothing queued starts afterwards
        and ``ExampleFeed.put`` raises. Unfinished rollouts are cancelled and their outcomes are
        never delivered. Outcomes that completed before the call (successes and failures) stay
        queued: consumers receive each of them exactly once (``take_ready``), then the stream is
        done. Every parked consumer is woken immediately.

        Waits for the same thing as :meth:`aclose` (local tasks only, never server cleanup).
        Returns the number of completed outcomes kept for delivery.
        """
        self._stop_admission()
        kept = len(self._ready)
        self._wake_all()
        await self._await_tasks(timeout)
        return kept

    async def _await_tasks(self, timeout: float | None) -> None:
        """Wait for the withdrawn rollouts to unwind, at most ``timeout`` seconds."""
        try:
            await self._tasks.aclose(timeout)
        except StillRunning as err:
            raise TimeoutError(
                f"rollout stream close: {len(err.tasks)} rollout task(s) still running {timeout}s "
                "after cancellation (fn is ignoring CancelledError?)"
            ) from err

    async def __aenter__(self) -> RolloutStream[E, R]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


_TIMED_OUT = object()


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(_TIMED_OUT)


def _discard(waiters: deque[asyncio.Future[None]], fut: asyncio.Future[Any]) -> None:
    try:
        waiters.remove(fut)
    except ValueError:
        pass


def run_examples(
    feed: ExampleFeed[E],
    fn: Callable[[E], Awaitable[R]],
    *,
    max_concurrency: int | None = None,
) -> RolloutStream[E, R]:
    """Run ``await fn(example)`` for every example put to ``feed``; return the stream of outcomes.

    Must be called from a running event loop. Examples put before the call start now (as many as
    ``max_concurrency`` lets), the others as they are put, until the feed is closed.
    """
    stream: RolloutStream[E, R] = RolloutStream(fn, max_concurrency=max_concurrency)
    feed._bind(stream)
    return stream

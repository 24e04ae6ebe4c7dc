"""Request starts spread over the event loop's steps.

A reload of every server ends each stream in flight and continues it as a new request, and the
requests that waited for the reload all wake in one step of the event loop: thousands of starts
(each a body to encode and a connection to open) in a single step, during which nothing else of
the loop runs, its timers and the streams still being read included (bench/test_fleet_bench.py:
the loop's lag). `StartPacer` lets at most `per_step` starts run in one step; the rest yield a
step at a time, so a wave of N starts takes N / per_step steps, each short.
"""

from __future__ import annotations

import asyncio
from collections import deque

STARTS_PER_STEP = 32


class StartPacer:
    """At most `per_step` request starts in one step of the event loop (see the module). Waiting
    starts queue, first come first through, and each step releases the next `per_step` of them:
    none spins, so a wave costs the loop no more than its starts."""

    def __init__(self, per_step: int = STARTS_PER_STEP) -> None:
        if per_step < 1:
            raise ValueError("per_step >= 1")
        self.per_step = per_step
        self._started = 0  # starts in the current step
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._step_scheduled = False

    async def turn(self) -> None:
        """Return once this step has room for one more start. Bounded: each step lets the next
        `per_step` waiting starts through."""
        if self._started < self.per_step and not self._waiting:
            self._started += 1
            self._schedule_next_step()
            return
        released = asyncio.get_running_loop().create_future()
        self._waiting.append(released)
        self._schedule_next_step()
        await released  # a cancelled wait leaves a cancelled future, which the release skips

    def _schedule_next_step(self) -> None:
        if not self._step_scheduled:
            self._step_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_step)

    def _next_step(self) -> None:
        """A new step: its room goes to the longest-waiting starts."""
        self._step_scheduled = False
        self._started = 0
        while self._waiting and self._started < self.per_step:
            released = self._waiting.popleft()
            if not released.done():
                released.set_result(None)
                self._started += 1
        if self._waiting:
            self._schedule_next_step()

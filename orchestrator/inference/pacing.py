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

STARTS_PER_STEP = 32


class StartPacer:
    """At most `per_step` request starts in one step of the event loop (see the module)."""

    def __init__(self, per_step: int = STARTS_PER_STEP) -> None:
        if per_step < 1:
            raise ValueError("per_step >= 1")
        self.per_step = per_step
        self._started = 0  # starts in the current step
        self._reset_scheduled = False

    async def turn(self) -> None:
        """Return once this step has room for one more start. Bounded: each step lets `per_step`
        of the waiting starts through, in the order they wait."""
        while self._started >= self.per_step:
            await asyncio.sleep(0)  # the reset below runs before the next step's waiters
        self._started += 1
        if not self._reset_scheduled:
            self._reset_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_step)

    def _next_step(self) -> None:
        self._started = 0
        self._reset_scheduled = False

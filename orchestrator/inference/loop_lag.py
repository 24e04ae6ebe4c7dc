"""How long orch's own event loop stalled lately, so that a timeout it caused is not blamed on
an endpoint.

A timeout measures the loop's time: when the loop is stalled (a CPU-bound step, thousands of
streams to parse), a connect the kernel finished long ago, or an answer already in the socket,
is seen only after the stall, by which time its timeout may have fired too. Such a timeout says
nothing about the endpoint. A repeating timer (a callback, not a task: nothing to own or await)
notes each time it ran late; a timeout whose window held a stall of at least a tenth of it is
orch's (docs/vllm.md, "Connections and timeouts").
"""

from __future__ import annotations

import asyncio
from collections import deque

TICK_S = 0.05
NOTED_S = 0.1  # a tick later than this is a stall worth noting
ORCH_SHARE = 0.1  # a timeout whose window was stalled for this share of it is orch's


class LoopLag:
    """The stalls of the running loop (started by `watch`, ended by `stop`)."""

    def __init__(self, keep_s: float) -> None:
        """`keep_s`: the longest timeout window its owner asks about; stalls are kept that long."""
        self.keep_s = keep_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._stalls: deque[tuple[float, float]] = deque()  # (loop time it ended, its length)

    def watch(self) -> None:
        """Starts noting the running loop's stalls (once per loop; cheap to call again)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._handle is not None:
            return
        self.stop()
        self._loop = loop
        self._due = loop.time() + TICK_S
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._loop = None, None
        self._stalls.clear()

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        late = now - self._due
        if late > NOTED_S:
            self._stalls.append((now, late))
            while self._stalls and self._stalls[0][0] < now - self.keep_s:
                self._stalls.popleft()
        self._due = now + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def stalled_s(self, window_s: float) -> float:
        """Seconds the loop was stalled within the last `window_s` seconds (the stall going on
        now included: the timer that would note it has not run yet)."""
        if self._loop is None:
            return 0.0
        now = self._loop.time()
        ongoing = max(0.0, now - self._due)
        since = now - window_s
        return ongoing + sum(min(late, end - since) for end, late in self._stalls if end > since)

    def caused(self, window_s: float) -> bool:
        """A timeout of `window_s` that fired now is orch's own lag's doing, not the endpoint's."""
        return self.stalled_s(window_s) >= ORCH_SHARE * window_s

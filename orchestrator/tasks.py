"""The one owner of a tree of asyncio tasks: the loop's, the background finalizer's and each
rollout stream's tasks are all held by a `TaskOwner`.

An owner starts its tasks (optionally one per key: starting another under a key cancels the one
it replaces), cancels one by key, reports every failure to its owner (never swallowed, never left
unretrieved on a task), and closes with a bound: `aclose` cancels what is left, waits at most
its timeout and names the tasks that outlived it. A cancelled task stays owned until it has
unwound, so a close waits for it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable, KeysView
from functools import partial
from typing import Any


class StillRunning(TimeoutError):
    """Tasks outlived `TaskOwner.aclose`'s bound (their work ignores its cancellation)."""

    def __init__(self, message: str, tasks: list[asyncio.Task[Any]]) -> None:
        super().__init__(message)
        self.tasks = tasks


class TaskOwner:
    """Owns the tasks it starts until each is done; see the module docstring.

    `on_failure` hears of each task that raised (its exception, in the task's done callback);
    without one, a failure goes to the event loop's exception handler, as asyncio reports an
    exception nobody retrieved, but at once and with the owner's name.
    """

    def __init__(self, name: str, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.name = name  # what the owner is, in messages
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()  # not done yet, cancelled ones included
        self._keyed: dict[Hashable, asyncio.Task[Any]] = {}  # the current task of each key, until cancelled or done

    def __len__(self) -> int:
        """Tasks not done yet, those cancelled and still unwinding included."""
        return len(self._tasks)

    def keys(self) -> KeysView[Hashable]:
        """The keys whose task is neither done nor cancelled."""
        return self._keyed.keys()

    def start(
        self, work: Coroutine[Any, Any, Any], *, name: str | None = None, key: Hashable | None = None
    ) -> asyncio.Task[Any]:
        """Run `work` as a task of this owner (named `name`, else asyncio's default name); under
        `key`, after cancelling the task that key had."""
        if key is not None:
            self.cancel(key)
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(partial(self._done, key))
        if key is not None:
            self._keyed[key] = task
        return task

    def cancel(self, key: Hashable) -> bool:
        """Cancel the task of `key`; False if it has none (never started, done or cancelled)."""
        task = self._keyed.pop(key, None)
        if task is None:
            return False
        task.cancel()
        return True

    def _done(self, key: Hashable | None, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if key is not None and self._keyed.get(key) is task:
            del self._keyed[key]
        if task.cancelled():
            return
        failure = task.exception()  # retrieved here, whoever waits for the task or not
        if failure is None:
            return
        if self._on_failure is not None:
            self._on_failure(failure)
        else:
            task.get_loop().call_exception_handler(
                {"message": f"a task of {self.name} failed", "exception": failure, "task": task}
            )

    async def aclose(self, timeout: float | None) -> None:
        """Cancel every task not done and wait for them at most `timeout` seconds; raise
        `StillRunning` naming those that outlived it. A task of this owner calling it is left
        alone (it cannot wait for itself). May be called again: it waits for what is left."""
        self._keyed.clear()
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, still_running = await asyncio.wait(tasks, timeout=timeout)
        if still_running:
            names = ", ".join(sorted(task.get_name() for task in still_running))
            raise StillRunning(
                f"{self.name}: {len(still_running)} task(s) still running {timeout:g}s after cancellation: {names}",
                list(still_running),
            )

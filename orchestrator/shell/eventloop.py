"""The event loop `orch run` runs on, with a bounded close, and the stop signals it handles."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from orchestrator.notices import warn


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (Linux, macOS): its task and callback machinery gives the
    loop more episodes/s (measured by bench/test_core_bench.py); asyncio's own loop elsewhere."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


LEFTOVER_WAIT_S = 10.0  # at exit, the longest wait for tasks cancelled because they outlived the run


def run_on_new_loop(coro):
    """Run `coro` with `asyncio.Runner` on the event loop `orch run` uses (`new_event_loop`), with
    a bounded close. The Runner's own close cancels the tasks still running when `coro` ends and
    waits for them without a bound: a task that ignores its cancellation (a rollout swallowing
    CancelledError) would hang the exit forever. So they are cancelled first here, waited for at
    most LEFTOVER_WAIT_S, then named on stderr and abandoned with the loop; the wait for worker
    threads is bounded the same way. Only a loop left with nothing running is closed by the Runner."""
    runner = asyncio.Runner(loop_factory=new_event_loop)
    try:
        return runner.run(coro)
    finally:
        loop = runner.get_loop()
        if runner.run(_close_leftovers(LEFTOVER_WAIT_S)):
            runner.close()
        else:
            loop.close()


async def _close_leftovers(timeout_s: float) -> bool:
    """Cancel the tasks left running, wait for them and for the worker threads (each at most
    `timeout_s`); True if nothing is left, else what is left was named in a warning."""
    tasks_done = await _cancel_leftover_tasks(timeout_s)
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    return await _shutdown_default_executor(loop, timeout_s) and tasks_done


async def _shutdown_default_executor(loop: asyncio.AbstractEventLoop, timeout_s: float) -> bool:
    """Join the `to_thread` workers, waiting at most `timeout_s`. A thread cannot be cancelled:
    one still busy is named in a warning, and Python joins it again at interpreter exit."""
    try:
        await asyncio.wait_for(loop.shutdown_default_executor(), timeout_s)
    except TimeoutError:
        warn(
            f"a worker thread (log commit, file write) was still busy {timeout_s:g}s after the run ended; "
            "the process exits once it returns"
        )
        return False
    return True


async def _cancel_leftover_tasks(timeout_s: float) -> bool:
    leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in leftovers:
        task.cancel()
    if not leftovers:
        return True
    _, stuck = await asyncio.wait(leftovers, timeout=timeout_s)
    loop = asyncio.get_running_loop()
    for task in leftovers:  # an error on the way out is reported, as asyncio.run reports it
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {"message": "unhandled exception during orch shutdown", "exception": task.exception(), "task": task}
            )
    if not stuck:
        return True
    names = sorted(task.get_name() for task in stuck)
    _quiet_about_destroying(loop, frozenset(names))
    warn(f"{len(stuck)} task(s) still running {timeout_s:g}s after cancellation at exit, abandoned: {', '.join(names)}")
    return False


def _quiet_about_destroying(loop: asyncio.AbstractEventLoop, abandoned: frozenset[str]) -> None:
    """Named in a warning already: asyncio would report each again when it is destroyed pending
    (with a traceback). By name, so the handler holds no reference that keeps them alive."""
    report = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        task = context.get("task")
        if (
            task is not None
            and task.get_name() in abandoned
            and context.get("message", "").startswith("Task was destroyed but it is pending")
        ):
            return
        if report is not None:
            report(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held_signals() -> Iterator[list[str]]:
    """The names of the SIGINT/SIGTERMs that arrive before the loop's own handlers are installed,
    kept (the loop handles them as if they came just after) rather than falling to Python's or
    asyncio's default handler (which abort at once); the previous handlers are restored at the end."""
    early: list[str] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: early.append(signal.Signals(signum).name)) for sig in STOP_SIGNALS
    }
    try:
        yield early
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""Run each async test on a fresh loop whose exception handler records every report.

A test fails if the loop reported anything (e.g. "Task exception was never retrieved", which
asyncio reports when an unretrieved task is garbage collected) or if tasks are left over when the
test coroutine returns (structured concurrency: nothing orphaned).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


def _run(make: Callable[[], Awaitable[Any]], timeout: float = 30.0, allow_leftovers: bool = False) -> Any:
    reports: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    leftovers: list[asyncio.Task[Any]] = []
    try:
        result = loop.run_until_complete(asyncio.wait_for(make(), timeout))
        leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
        # Collect garbage while the loop (and its handler) is alive: unretrieved task exceptions
        # are reported from Task.__del__.
        gc.collect()
        loop.run_until_complete(asyncio.sleep(0))
        gc.collect()
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    assert not reports, f"event loop reported: {[c.get('message') for c in reports]} {reports}"
    if not allow_leftovers:
        assert not leftovers, f"orphaned tasks after the test: {leftovers}"
    return result


@pytest.fixture
def arun() -> Callable[..., Any]:
    return _run

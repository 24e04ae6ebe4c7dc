"""`orch run` runs on uvloop where it is installed (see orchestrator.shell.eventloop.new_event_loop)."""

import asyncio

import pytest

from orchestrator.shell.eventloop import new_event_loop


def test_the_run_loop_is_uvloop_where_installed():
    uvloop = pytest.importorskip("uvloop")
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.to_thread(sum, [1, 2])) == 3  # worker threads work
    finally:
        loop.close()

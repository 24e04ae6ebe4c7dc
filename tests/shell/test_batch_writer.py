"""BatchWriter: batch files written off the loop, in step order, each announced once on disk."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orchestrator.shell.loop import BatchWriter


def test_batches_are_written_in_order_and_announced_after_their_write():
    written, announced = [], []

    def write(step, sha256, samples):
        assert threading.current_thread() is not threading.main_thread()  # off the loop thread
        written.append(step)

    def announce(step, sha256):
        assert step in written
        announced.append((step, sha256))

    async def main():
        writer = BatchWriter(write, announce)
        for step in range(1, 6):
            writer.submit(step, f"sha{step}", [])
            await asyncio.sleep(0)
        await writer.flush(timeout_s=5)
        writer.submit(6, "sha6", [])  # a new burst after the queue emptied
        await writer.flush(timeout_s=5)

    asyncio.run(main())
    assert written == [1, 2, 3, 4, 5, 6]
    assert announced == [(s, f"sha{s}") for s in range(1, 7)]


def test_a_failed_write_is_raised_and_nothing_after_it_is_announced():
    announced = []

    def write(step, sha256, samples):
        if step == 2:
            raise OSError("disk full")

    async def main():
        writer = BatchWriter(write, lambda step, sha: announced.append(step))
        for step in (1, 2, 3):
            writer.submit(step, "x", [])
        with pytest.raises(OSError, match="disk full"):
            await writer.flush(timeout_s=5)
        with pytest.raises(OSError, match="disk full"):
            writer.check()  # and again at the loop's next check
        await writer.aclose(timeout_s=5)

    asyncio.run(main())
    assert announced == [1]


def test_flush_is_bounded_and_says_what_it_waits_for():
    release = threading.Event()

    async def main():
        writer = BatchWriter(lambda step, sha, samples: release.wait(5), lambda step, sha: None)
        writer.submit(1, "x", [])
        writer.submit(2, "x", [])
        with pytest.raises(TimeoutError, match="2 batch files still being written"):
            await writer.flush(timeout_s=0.05)
        release.set()
        await writer.aclose(timeout_s=5)

    asyncio.run(main())

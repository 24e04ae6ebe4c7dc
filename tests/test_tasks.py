"""TaskOwner: tasks by key, failures reported (never swallowed), a bounded close naming stragglers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.tasks import StillRunning, TaskOwner


def _run(main) -> list[dict[str, Any]]:
    """Run `main()` on a fresh loop; return what the loop's exception handler was told."""
    reports: list[dict[str, Any]] = []

    async def recording():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reports.append(context))
        await main()

    asyncio.run(recording())
    return reports


async def _forever() -> None:
    await asyncio.sleep(3600)


async def _settle() -> None:
    """Let the cancelled tasks unwind and their done callbacks run."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_key_has_one_task_and_cancel_by_key():
    async def main():
        owner = TaskOwner("test")
        first = owner.start(_forever(), key="g")
        second = owner.start(_forever(), key="g")  # replaces the first, which is cancelled
        other = owner.start(_forever(), name="unkeyed")
        await _settle()
        assert first.cancelled() and not second.done() and other.get_name() == "unkeyed"
        assert list(owner.keys()) == ["g"] and len(owner) == 2
        assert owner.cancel("g") is True and owner.cancel("g") is False and owner.cancel("never") is False
        await _settle()
        assert second.cancelled() and not owner.keys() and len(owner) == 1
        await owner.aclose(1)
        assert other.cancelled() and len(owner) == 0

    assert _run(main) == []


def test_every_failure_is_reported_once_to_the_owner():
    async def main():
        failures: list[BaseException] = []
        owner = TaskOwner("test", failures.append)

        async def fails(n: int) -> None:
            raise ValueError(n)

        async def returns() -> int:
            return 1

        for n in range(3):
            owner.start(fails(n), key=n)
        owner.start(returns())
        await asyncio.sleep(0.01)
        assert sorted(str(f) for f in failures) == ["0", "1", "2"] and len(owner) == 0

    assert _run(main) == []  # retrieved: nothing "never retrieved"


def test_without_a_listener_a_failure_goes_to_the_loops_handler():
    async def main():
        owner = TaskOwner("the test's owner")

        async def fails() -> None:
            raise RuntimeError("boom")

        owner.start(fails())
        await asyncio.sleep(0.01)

    reports = _run(main)
    assert [r["message"] for r in reports] == ["a task of the test's owner failed"]
    assert str(reports[0]["exception"]) == "boom"


def test_aclose_is_bounded_and_names_what_outlived_it():
    async def main():
        release = asyncio.Event()

        async def stubborn() -> None:
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    continue  # ignores its cancellation until released

        owner = TaskOwner("the test's owner")
        owner.start(stubborn(), name="stubborn-1")
        owner.start(_forever(), name="polite")
        await _settle()  # both waiting: a task cancelled before its first step never runs
        with pytest.raises(StillRunning) as raised:
            await owner.aclose(0.05)
        assert str(raised.value) == "the test's owner: 1 task(s) still running 0.05s after cancellation: stubborn-1"
        assert [t.get_name() for t in raised.value.tasks] == ["stubborn-1"] and len(owner) == 1
        release.set()
        await owner.aclose(1)  # again: it waits for what is left
        assert len(owner) == 0

    assert _run(main) == []


def test_a_task_closing_its_own_owner_is_not_waited_for():
    async def main():
        owner = TaskOwner("test")
        other = owner.start(_forever())

        async def closes() -> None:
            await owner.aclose(1)

        await asyncio.wait_for(owner.start(closes()), 1)
        assert other.cancelled()

    assert _run(main) == []

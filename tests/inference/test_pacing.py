"""StartPacer: at most `per_step` starts in one step of the event loop, the rest in later steps,
in the order they waited (orchestrator/inference/pacing.py)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.inference.pacing import StartPacer
from tests.inference.util import run


def test_a_wave_of_starts_is_spread_over_loop_steps_in_order():
    async def go() -> list[tuple[int, int]]:
        pacer, step, order = StartPacer(per_step=4), 0, []
        stop = asyncio.Event()

        async def count_steps() -> None:
            nonlocal step
            while not stop.is_set():
                await asyncio.sleep(0)
                step += 1

        async def start(k: int) -> None:
            await pacer.turn()
            order.append((k, step))

        counter = asyncio.create_task(count_steps())
        await asyncio.gather(*(start(k) for k in range(10)))
        stop.set()
        await counter
        return order

    order = run(go())
    assert [k for k, _ in order] == list(range(10))  # first come, first through
    steps = [s for _, s in order]
    assert all(steps.count(s) <= 4 for s in steps)  # never more than per_step in one step
    assert len(set(steps)) == 3  # 10 starts at 4 a step: three steps


def test_per_step_must_be_positive():
    with pytest.raises(ValueError):
        StartPacer(per_step=0)

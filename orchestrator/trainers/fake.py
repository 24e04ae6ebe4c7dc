"""`fake`: an in-process trainer that reads each shipped batch file in order (checking its
sha256 against the log), waits `step_time_s` and publishes N. A real code path for tests and
benchmarks; it writes no weights."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from orchestrator.components import BuildContext, TrainerComponent
from orchestrator.rundir import batch_path
from orchestrator.trainers import TrainerFailed


class FakeTrainerConfig(TrainerComponent):
    """The in-process fake trainer (no model, no weights)."""

    writes_weights: ClassVar[bool] = False
    resumable: ClassVar[frozenset[str]] = frozenset({"step_time_s"})
    step_time_s: float = Field(0.0, ge=0, description="time per optimizer step")

    def build(self, ctx: BuildContext) -> FakeTrainer:
        return FakeTrainer(ctx.run_dir, self.step_time_s)


class FakeTrainer:
    def __init__(self, run_dir: Path, step_time_s: float):
        self.run_dir, self.step_time_s = run_dir, step_time_s
        self._shipped: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    def batch_written(self, step: int, sha256: str) -> None:
        self._shipped.put_nowait((step, sha256))

    async def start(self) -> None:
        """Nothing runs outside this process."""

    async def run(self, version: int, publish: Callable[[int], None]) -> None:
        """Train on shipped batches in step order, forever (the owner cancels it)."""
        expected = version + 1
        while True:
            step, sha256 = await self._shipped.get()
            if step < expected:  # re-announced after a resume; already trained
                continue
            if step != expected:
                raise TrainerFailed(f"fake trainer: got batch {step} while waiting for batch {expected}")
            await asyncio.to_thread(self._read_batch, step, sha256)
            if self.step_time_s:
                await asyncio.sleep(self.step_time_s)
            publish(step)
            expected = step + 1

    def _read_batch(self, step: int, sha256: str) -> None:
        # The logged sha256 covers the whole file, its step included: matching it proves the file
        # is batch `step`, as the orchestrator shipped it.
        payload = batch_path(self.run_dir, step).read_bytes()
        if hashlib.sha256(payload).hexdigest() != sha256:
            raise TrainerFailed(f"fake trainer: batch {step} on disk does not match its logged sha256")

    def check(self) -> None:
        """In-process: failures surface through its task."""

    async def stop(self, timeout_s: float) -> None:
        """Nothing to stop beyond its task, which the loop owns."""

"""`fake`: an in-process trainer that reads each shipped batch file in order (checking its
sha256 against the log), waits `step_time_s` and publishes N with the figures it measured (the
batch's sampled tokens and samples, its step time). A real code path for tests and benchmarks; it
writes no weights."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from orchestrator.contracts import BuildContext, Publish, TrainerComponent
from orchestrator.rundir import BatchFileError, batch_path, read_batch_file
from orchestrator.trainers import TrainerFailed


class FakeTrainerConfig(TrainerComponent):
    """The in-process fake trainer (no model, no weights)."""

    writes_weights: ClassVar[bool] = False
    resumable: ClassVar[frozenset[str]] = frozenset({"step_time_s"})
    step_time_s: float = Field(0.0, ge=0, description="time per optimizer step")

    def build(self, ctx: BuildContext) -> FakeTrainer:
        return FakeTrainer(ctx.run_dir, self.step_time_s)


class FakeTrainer:
    def __init__(self, run_dir: Path, step_time_s: float, clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.step_time_s, self.clock = run_dir, step_time_s, clock
        self._shipped: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    def batch_written(self, step: int, sha256: str) -> None:
        self._shipped.put_nowait((step, sha256))

    async def start(self) -> None:
        """Nothing runs outside this process."""

    def report_restarts_to(self, listener: Callable[[int, str], None]) -> None:
        """It never restarts: nothing runs outside this process."""

    async def run(self, version: int, publish: Publish) -> None:
        """Train on shipped batches in step order, forever (the owner cancels it)."""
        expected = version + 1
        while True:
            step, sha256 = await self._shipped.get()
            if step < expected:  # re-announced after a resume; already trained
                continue
            if step != expected:
                raise TrainerFailed(f"fake trainer: got batch {step} while waiting for batch {expected}")
            started = self.clock()
            metrics = await asyncio.to_thread(self._read_batch, step, sha256)
            if self.step_time_s:
                await asyncio.sleep(self.step_time_s)
            metrics["step_time_s"] = self.clock() - started
            publish(step, metrics)
            expected = step + 1

    def _read_batch(self, step: int, sha256: str) -> dict[str, int | float]:
        """Check batch `step` on disk and return what the fake trainer can honestly report of it:
        its samples and sampled tokens."""
        # The logged sha256 covers the whole file, its step included: matching it proves the file
        # is batch `step`, as the orchestrator shipped it.
        payload = batch_path(self.run_dir, step).read_bytes()
        if hashlib.sha256(payload).hexdigest() != sha256:
            raise TrainerFailed(f"fake trainer: batch {step} on disk does not match its logged sha256")
        try:
            batch = read_batch_file(payload, step, str(batch_path(self.run_dir, step)))
        except BatchFileError as err:
            raise TrainerFailed(f"fake trainer: {err}") from None
        return {"samples": len(batch), "tokens": int(batch.mask.sum(dtype="int64"))}

    def check(self) -> None:
        """In-process: failures surface through its task."""

    async def stop(self, timeout_s: float) -> None:
        """Nothing to stop beyond its task, which the loop owns."""

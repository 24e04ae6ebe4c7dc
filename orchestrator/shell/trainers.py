"""Trainer backends and the weight watcher.

Both backends turn "the trainer finished step N" into one call of `publish(N, metrics)`, which
the main loop turns into a `version_published` input (rule 8: the version advances at
confirmation) carrying the trainer's figures for that step.

* `FakeTrainer`: in-process; reads each shipped batch file in order (checking its sha256 against
  the log), waits `step_time_s`, publishes N with the figures it measured (the batch's sampled
  tokens and samples, its step time). A real code path for tests and benchmarks.
* `ProcessTrainer`: supervises `orch trainer` (torch) as a child process; its watcher polls
  `weights/step_N/STABLE` markers and reads the step's `metrics.json` beside the marker. A crash
  of the child is noticed within one poll.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from orchestrator.rundir import batch_path, latest_stable_version, read_metrics, weights_dir
from orchestrator.shell.loop import warn

Publish = Callable[[int, "dict[str, int | float] | None"], None]  # (version, the trainer's metrics)


class _SampleMask(msgspec.Struct, gc=False):
    mask: list[int]


class _BatchMasks(msgspec.Struct, gc=False):
    samples: list[_SampleMask]


# What the fake trainer reads of a batch: its samples' masks (the rest is skipped, not built: half
# the cost of a full parse, in a thread beside the loop).
_decode_masks = msgspec.json.Decoder(_BatchMasks).decode


class TrainerFailed(RuntimeError):
    """The trainer died or stopped answering; the message says why, in one line."""


class FakeTrainer:
    def __init__(self, run_dir: Path, step_time_s: float, publish: Publish,
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.step_time_s, self.publish, self.clock = run_dir, step_time_s, publish, clock
        self._shipped: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    def batch_written(self, step: int, sha256: str) -> None:
        self._shipped.put_nowait((step, sha256))

    async def run(self, version: int) -> None:
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
            self.publish(step, metrics)
            expected = step + 1

    def _read_batch(self, step: int, sha256: str) -> dict[str, int | float]:
        """Check batch `step` on disk and return what the fake trainer can honestly report of it:
        its samples and sampled tokens."""
        # The logged sha256 covers the whole file, its step included: matching it proves the file
        # is batch `step`, as the orchestrator shipped it.
        payload = batch_path(self.run_dir, step).read_bytes()
        if hashlib.sha256(payload).hexdigest() != sha256:
            raise TrainerFailed(f"fake trainer: batch {step} on disk does not match its logged sha256")
        samples = _decode_masks(payload).samples
        return {"samples": len(samples), "tokens": sum(sum(sample.mask) for sample in samples)}

    def check(self) -> None:
        """In-process: failures surface through its task."""

    async def stop(self, timeout_s: float) -> None:
        """Nothing to stop beyond its task, which the loop owns."""


class ProcessTrainer:
    """`orch trainer --run-dir D` as a supervised child process."""

    def __init__(self, run_dir: Path, publish: Publish, poll_s: float = 0.05):
        self.run_dir, self.publish, self.poll_s = run_dir, publish, poll_s
        self.log_path = run_dir / "trainer.log"
        self.proc: subprocess.Popen | None = None
        self._published = -1
        self._log_start = 0  # where this process's output starts in trainer.log (appended to)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "orchestrator.cli", "trainer", "--run-dir", str(self.run_dir)]

    def start(self) -> None:
        log = open(self.log_path, "ab")
        try:
            self._log_start = log.seek(0, os.SEEK_END)
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # Its own session: a Ctrl-C in the terminal reaches the orchestrator only, which
                # drains and then stops the trainer itself. The child's parent watchdog still
                # ends it if the orchestrator dies.
                start_new_session=True,
            )
        finally:
            log.close()

    def batch_written(self, step: int, sha256: str) -> None:
        """The child polls the batch directory itself."""

    async def run(self, version: int) -> None:
        """Watch for STABLE markers and the child's health, forever (the owner cancels it)."""
        self._published = version
        while True:
            self.check()
            newest = await asyncio.to_thread(latest_stable_version, self.run_dir)
            if newest is not None and newest > self._published:
                self._published = newest
                self.publish(newest, await asyncio.to_thread(self._metrics_of, newest))
            await asyncio.sleep(self.poll_s)

    def _metrics_of(self, version: int) -> dict[str, int | float] | None:
        """The figures the trainer wrote beside version `version`'s marker (None: it wrote none,
        e.g. for its warm start). Entries that are not finite numbers are left out, with a warning:
        a NaN loss is the trainer's news, not a reason to stop the run."""
        wdir = weights_dir(self.run_dir, version)
        metrics, refused = read_metrics(wdir)
        if refused:
            what = "is not a JSON object" if refused == ["*"] else f"has non-finite or non-numeric {', '.join(refused)}"
            warn(f"{wdir}/metrics.json {what}; left out of the log")
        return metrics

    def _last_error_line(self) -> str:
        """The last error line this trainer process wrote (not an earlier one's: the log is
        appended to across resumes)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no trainer.log)"
        for marker in ("orch trainer: error:", "error"):  # its own one-line summary first
            for line in reversed(lines):
                if marker in line.lower():
                    return line.strip()
        return lines[-1].strip() if lines else "(it wrote nothing to trainer.log)"

    def check(self) -> None:
        if self.proc is None:
            return
        code = self.proc.poll()
        if code not in (None, 0):
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise TrainerFailed(f"trainer {how}: {self._last_error_line()} (see {self.log_path})")

    def exited_ok(self) -> bool:
        return self.proc is not None and self.proc.poll() == 0

    async def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a clean exit, then SIGTERM, then SIGKILL: never orphaned."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for action, wait_s in ((None, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if action is not None:
                os.kill(proc.pid, action)
            try:
                await asyncio.to_thread(proc.wait, wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

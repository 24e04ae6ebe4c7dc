"""The trainer process (`orch trainer`, or its ranks under torchrun: the hf trainer's)
supervised as a child; a poll of `weights/step_N/STABLE` markers publishes each new version, in
order, with the step's `metrics.json` beside the marker. A crash of the child is noticed within one poll.

The single-process trainer may be started before its run directory exists (`EarlyTrainer`): its
imports (torch, transformers: seconds) then overlap the orchestrator's own checks of the model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from orchestrator.contracts import Publish
from orchestrator.notices import warn
from orchestrator.rundir import (
    ckpt_dir,
    clean_tmp,
    read_metrics,
    stable_versions,
    trainer_log,
    weights_dir,
    weights_root,
)
from orchestrator.trainers import TrainerFailed

REFUSAL = "orch trainer: error:"  # the trainer's own one-line refusal (a bad batch, a bad model)
KILL_WAIT_S = 5.0  # the longest wait to reap a SIGKILLed child

START_LINE = b"start\n"  # what the orchestrator writes to a waiting trainer once its trainer.json is written


def trainer_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", "trainer", "--run-dir", str(run_dir)]


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


class EarlyTrainer:
    """`orch trainer --run-dir D --wait-for-start`, started before D exists: it imports torch and
    transformers while the orchestrator checks the model and creates the run, then waits for the
    start line (`ProcessTrainer.start` writes it once trainer.json is written). Its output until
    then is held in a temporary file, which it copies into trainer.log when it starts.

    Never left behind: `close` (the run's, at its end) kills it if it was not started; if the
    orchestrator dies first, the trainer reads the end of its input and exits."""

    def __init__(self, run_dir: Path):
        with tempfile.TemporaryFile() as held:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [*trainer_command(run_dir), "--wait-for-start"],
                stdin=subprocess.PIPE,
                stdout=held,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                start_new_session=True,  # as ProcessTrainer's: a Ctrl-C reaches the orchestrator only
            )

    def start(self) -> subprocess.Popen | None:
        """Tell it to train (its trainer.json is written); the process, or None if it is gone
        (it died importing: a trainer started now tells why in trainer.log)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        try:
            proc.stdin.write(START_LINE)
            proc.stdin.close()
        except OSError:  # it exited: its end of the pipe is closed
            _kill(proc)
            return None
        return proc

    def close(self) -> None:
        """Kill it unless it was started (a refused model, an interrupt before the run ran)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill(proc)
            proc.stdin.close()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # not reaped yet: named, never hiding the error being handled
        warn(f"the trainer process {proc.pid} did not exit within {KILL_WAIT_S:g}s of its SIGKILL")


class ProcessTrainer:
    """`orch trainer --run-dir D` as a supervised child process."""

    def __init__(self, run_dir: Path, poll_s: float = 0.05, max_restarts: int = 0, early: EarlyTrainer | None = None):
        self.run_dir, self.poll_s = run_dir, poll_s
        self.early = early  # started before the run dir existed: `start` starts it
        self.log_path = trainer_log(run_dir)
        self.proc: subprocess.Popen | None = None
        self._published = -1
        self._log_start = 0  # where this process's output starts in trainer.log (appended to)
        # A child killed or crashed is started again from its checkpoint this many times
        # (`trainer.max_restarts`); `on_restart(attempt, cause)` tells the run (a logged input).
        self.max_restarts = max_restarts
        self.restarts = 0
        self.on_restart: Callable[[int, str], None] | None = None

    def command(self) -> list[str]:
        return trainer_command(self.run_dir)

    async def start(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            with open(self.log_path, "ab") as log:
                self._log_start = log.seek(0, os.SEEK_END)
            self.proc = early.start()
        if self.proc is None:
            self._spawn()

    def _spawn(self) -> None:
        log = open(self.log_path, "ab")
        try:
            self._log_start = log.seek(0, os.SEEK_END)
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_child_env(),
                # Its own session: a Ctrl-C in the terminal reaches the orchestrator only, which
                # drains and then stops the trainer itself. The child's parent watchdog still
                # ends it if the orchestrator dies.
                start_new_session=True,
            )
        finally:
            log.close()

    def batch_written(self, step: int, sha256: str) -> None:
        """The child polls the batch directory itself."""

    async def run(self, version: int, publish: Publish) -> None:
        """Watch for STABLE markers and the child's health, forever (the owner cancels it)."""
        self._published = version
        while True:
            self.check()
            # Every version marked since the last poll, in order, each with its own metrics: a
            # trainer (restarted from its checkpoint, say) may mark several within one poll.
            for version in await asyncio.to_thread(stable_versions, self.run_dir):
                if version > self._published:
                    self._published = version
                    publish(version, await asyncio.to_thread(self._metrics_of, version))
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

    def report_restarts_to(self, listener: Callable[[int, str], None]) -> None:
        self.on_restart = listener

    def _last_error_line(self) -> tuple[str | None, str]:
        """The last error line this trainer process wrote (not an earlier one's: the log is
        appended to across resumes): its own one-line summary, else a traceback's last line, else
        any line naming an error; and what to say of it. A trainer killed by a signal writes none:
        then that is said, not its last progress line quoted as if it were the error."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return None, "no trainer.log"
        for marker in (REFUSAL, "error", "exception"):
            for line in reversed(lines):
                if marker in line.lower():
                    return line, f"its last error line: {line}"
        return None, "it logged no error" if lines else "it wrote nothing to trainer.log"

    def check(self) -> None:
        """Raise TrainerFailed if the child died; one killed or crashed is restarted instead, from
        its checkpoint (at most `max_restarts` times). One that refused something itself (its own
        `orch trainer: error:` line: a bad batch, a bad model) would refuse it again: not restarted."""
        if self.proc is None:
            return
        code = self.proc.poll()
        if code in (None, 0):
            return
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        line, said = self._last_error_line()
        cause = f"trainer {how}; {said}"
        refused = line is not None and REFUSAL in line.lower()
        if self.restarts < self.max_restarts and not refused:
            self.restarts += 1
            warn(f"{cause}; restarting it from its checkpoint (restart {self.restarts} of {self.max_restarts})")
            self._spawn()
            if self.on_restart is not None:
                self.on_restart(self.restarts, cause)
            return
        after = f", after {self.restarts} restart(s)" if self.restarts else ""
        raise TrainerFailed(f"{cause} (see {self.log_path}{after})")

    async def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a clean exit, then SIGTERM, then SIGKILL: never orphaned.
        A trainer stopped (or dead) mid-write, e.g. on a full disk, leaves a temp sibling of its
        checkpoint or weights: removed once it is gone."""
        proc = self.proc
        if proc is None:
            return
        try:
            for action, wait_s in ((None, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if proc.poll() is not None:
                    return
                if action == signal.SIGKILL:  # its whole session (a guard's srun, say), not its leader alone
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, action)
                elif action is not None:
                    os.kill(proc.pid, action)
                try:
                    await asyncio.to_thread(proc.wait, wait_s)
                    return
                except subprocess.TimeoutExpired:
                    continue
        finally:
            if proc.poll() is not None:
                for directory in (weights_root(self.run_dir), ckpt_dir(self.run_dir)):
                    clean_tmp(directory)

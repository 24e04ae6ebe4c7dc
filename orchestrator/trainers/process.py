"""`embedded`: the torch trainer process (`orch trainer`, or its DDP ranks under torchrun)
supervised as a child; a poll of `weights/step_N/STABLE` markers publishes each version with the
step's `metrics.json` beside the marker. A crash of the child is noticed within one poll."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from orchestrator.components import BuildContext, Publish, TrainerComponent
from orchestrator.notices import warn
from orchestrator.rundir import latest_stable_version, read_metrics, trainer_log, weights_dir
from orchestrator.trainers import TrainerFailed

if TYPE_CHECKING:
    from orchestrator.config import RunConfig


class EmbeddedTrainerConfig(TrainerComponent):
    """The embedded torch trainer process (reverse_text)."""

    resumable: ClassVar[frozenset[str]] = frozenset({"nproc", "ddp_backend"})
    lr: float = Field(2e-3, gt=0, description="learning rate")
    sft_steps: int = Field(400, ge=0, description="most warm-start steps (it stops at a loss of 0.12)")
    nproc: int = Field(1, ge=1, description="ranks under torchrun (DDP); 1 = one plain process")
    ddp_backend: Literal["auto", "gloo", "nccl"] = Field("auto",
                                                         description="DDP backend (auto: nccl with CUDA, else gloo)")

    def check(self, run: RunConfig) -> None:
        if set(run.envs) != {"reverse_text"}:
            raise ValueError("the embedded trainer learns reverse_text only; use trainer.kind='fake' for other envs")

    def build(self, ctx: BuildContext) -> ProcessTrainer:
        write_embedded_trainer_config(ctx.config, ctx.run_dir)
        if self.nproc > 1:  # DDP under torchrun, supervised the same way
            from orchestrator.trainers.torchrun import TorchrunTrainer

            return TorchrunTrainer(ctx.run_dir, self.nproc, self.ddp_backend)
        return ProcessTrainer(ctx.run_dir)


def write_embedded_trainer_config(config: RunConfig, run_dir: Path) -> None:
    from orchestrator.embedded.defaults import KEEP_WEIGHTS as DEFAULT_KEEP_WEIGHTS
    from orchestrator.embedded.trainer import (  # torch
        TrainerConfig,
        write_trainer_config,
    )

    ours, env = config.trainer.embedded, config.env.reverse_text
    config_for_trainer = TrainerConfig(
        max_steps=config.max_steps, lr=ours.lr, seed=config.seed, sft_steps=ours.sft_steps,
        env_min_len=env.min_len, env_max_len=env.max_len, temperature=config.rollout.temperature,
        max_new_tokens=config.rollout.max_new_tokens,
        batch_wait_timeout_s=config.trainer.publish_timeout_s, parent_pid=os.getpid(),
        # The trainer may publish up to target_lag + 1 versions the log has not recorded yet (a
        # crash); a resume reloads the newest recorded one, which must still be on disk.
        keep_weights=max(DEFAULT_KEEP_WEIGHTS, config.off_policy.target_lag + 2),
    )
    try:
        write_trainer_config(run_dir, config_for_trainer)
    except OSError as err:  # e.g. a directory in its place: one line, like the trainer's own failures
        raise TrainerFailed(f"cannot write the trainer's config in {run_dir}: {err.strerror or err}") from err


class ProcessTrainer:
    """`orch trainer --run-dir D` as a supervised child process."""

    def __init__(self, run_dir: Path, poll_s: float = 0.05):
        self.run_dir, self.poll_s = run_dir, poll_s
        self.log_path = trainer_log(run_dir)
        self.proc: subprocess.Popen | None = None
        self._published = -1
        self._log_start = 0  # where this process's output starts in trainer.log (appended to)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "orchestrator.cli", "trainer", "--run-dir", str(self.run_dir)]

    async def start(self) -> None:
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

    async def run(self, version: int, publish: Publish) -> None:
        """Watch for STABLE markers and the child's health, forever (the owner cancels it)."""
        self._published = version
        while True:
            self.check()
            newest = await asyncio.to_thread(latest_stable_version, self.run_dir)
            if newest is not None and newest > self._published:
                self._published = newest
                publish(newest, await asyncio.to_thread(self._metrics_of, newest))
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

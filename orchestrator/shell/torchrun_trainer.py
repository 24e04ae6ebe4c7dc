"""`TorchrunTrainer`: the embedded trainer under torchrun (DDP), supervised like `ProcessTrainer`.

The child is ``python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 0
-m orchestrator.embedded.ddp --run-dir RUN_DIR``; weights are watched exactly as for the
single-process trainer (STABLE markers, published by rank 0).

Supervision of the process tree (orchestrator -> torchrun agent -> N ranks):

* crash: a rank that fails makes the agent stop the other ranks and exit non-zero (no restarts),
  which ``check()`` reports with the last error line of ``trainer.log`` (every rank's output goes
  there);
* stop (inherited): wait for a clean exit, else SIGTERM to the agent, which forwards it to the
  ranks (each in its own session) and waits for them, else SIGKILL to the agent;
* no orphans: each rank exits within ~0.2 s once its agent or the orchestrator is gone (parent
  watchdogs in :mod:`orchestrator.embedded.ddp`), so even a SIGKILLed agent leaves nothing behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.shell.trainers import ProcessTrainer, Publish


def torchrun_command(run_dir: Path, nproc: int, backend: str = "auto") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "-m", "orchestrator.embedded.ddp", "--run-dir", str(run_dir), "--backend", backend]


class TorchrunTrainer(ProcessTrainer):
    def __init__(self, run_dir: Path, publish: Publish, nproc: int, backend: str = "auto",
                 poll_s: float = 0.05):
        super().__init__(run_dir, publish, poll_s)
        self.nproc, self.backend = nproc, backend

    def command(self) -> list[str]:
        return torchrun_command(self.run_dir, self.nproc, self.backend)

"""`TorchrunTrainer`: the hf trainer under torchrun (N ranks, DDP or FSDP2), supervised like
`ProcessTrainer` (`trainer.hf.nproc` > 1 or `trainer.hf.nnodes` > 1).

The child is :func:`orchestrator.hf.distributed.torchrun_command` (``python -m
torch.distributed.run ... --max-restarts=0 -m orchestrator.cli trainer --run-dir RUN_DIR``):
standalone on one node, or node ``node_rank`` of ``nnodes`` meeting at ``rdzv_endpoint``.
Weights are watched exactly as for the single-process trainer (STABLE markers, by rank 0).

Supervision of the process tree (orchestrator -> torchrun agent -> N ranks):

* crash: a rank that fails makes the agent stop the other ranks and exit non-zero (no restarts),
  which ``check()`` reports with the last error line of ``trainer.log`` (every rank's output goes
  there);
* stop (inherited): wait for a clean exit, else SIGTERM to the agent, which forwards it to the
  ranks and waits for them, else SIGKILL to the agent;
* no orphans: each rank exits within ~0.2 s once its agent or the orchestrator is gone (parent
  watchdogs in :mod:`orchestrator.hf.trainer`), so even a SIGKILLed agent leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.trainers.process import ProcessTrainer


class TorchrunTrainer(ProcessTrainer):
    def __init__(self, run_dir: Path, command: list[str], poll_s: float = 0.05, max_restarts: int = 0):
        """`command`: the torchrun command line (the hf trainer's: orchestrator.hf.distributed)."""
        super().__init__(run_dir, poll_s, max_restarts)
        self._command = command

    def command(self) -> list[str]:
        return self._command

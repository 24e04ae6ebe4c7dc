"""`TorchrunTrainer`: the hf trainer under torchrun (N ranks, DDP or FSDP2), supervised like
`ProcessTrainer`.

The child is :func:`orchestrator.hf.distributed.torchrun_command` (``python -m
torch.distributed.run ... --max-restarts=0 -m orchestrator.hf.trainer --run-dir RUN_DIR``):
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

from orchestrator.config import TrainerSection
from orchestrator.hf.distributed import torchrun_command
from orchestrator.shell.trainers import ProcessTrainer, Publish


class TorchrunTrainer(ProcessTrainer):
    def __init__(self, run_dir: Path, publish: Publish, section: TrainerSection, poll_s: float = 0.05):
        super().__init__(run_dir, publish, poll_s)
        self.section = section

    def command(self) -> list[str]:
        s = self.section
        return torchrun_command(self.run_dir, nproc=s.nproc, nnodes=s.nnodes, node_rank=s.node_rank,
                                rdzv_endpoint=s.rdzv_endpoint)

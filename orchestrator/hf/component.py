"""`hf`: the transformers trainer process (full fine-tuning or LoRA; one process, or torchrun's
ranks with DDP or FSDP2) on the run's `model` dir, as a run composes it: its config section,
`trainer.hf` (the training settings, `TrainingSettings`, shared with the process's trainer.json,
plus how its processes are started), and its factory. Light: the factory's module
(orchestrator.hf.factory) is imported only in `prepare_model` and `build`."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from orchestrator.contracts import (
    BuildContext,
    ConfigError,
    ModelRequest,
    PreparedModel,
    RunPlan,
    StartedEarly,
    Trainer,
    TrainerComponent,
)
from orchestrator.hf.config import HFTrainerSettings


class HFTrainerConfig(TrainerComponent, HFTrainerSettings):
    """The transformers trainer process (full or LoRA, torchrun DDP/FSDP2): docs/hf.md."""

    resumable: ClassVar[frozenset[str]] = frozenset(
        {"nproc", "distributed", "backend", "nnodes", "node_rank", "rdzv_endpoint", "min_step_time_s"}
    )
    weight_format: ClassVar[str | None] = "hf"
    refuses_synthetic: ClassVar[str | None] = (
        "the hf trainer learns the model's own tokens, not the {envs} env's; use trainer.kind='fake' for it"
    )

    def prepare_model(self, request: ModelRequest, stored_hash: str | None) -> PreparedModel:
        from orchestrator.hf.factory import prepare_model  # transformers: only now
        from orchestrator.hf.model import ModelError

        try:
            return prepare_model(request, self, stored_hash)
        except ModelError as err:
            raise ConfigError(str(err)) from None

    def push_refusal(self, servers_transport: str | None) -> str | None:
        if self.lora.rank:
            return (
                "trainer.hf.lora trains adapters, which vLLM loads from the weights dir as adapters, not "
                "pushed (weight_sync 'vllm_lora')"
            )
        if servers_transport not in (None, self.push.transport) and self.push.transport != "auto":
            gpus = "inference.openai.launch.gpus" if servers_transport == "nccl" else "no inference.openai.launch.gpus"
            return (
                f"trainer.hf.push.transport is '{self.push.transport}', but the servers orch launches receive "
                f"over {servers_transport} ({gpus}): set it to '{servers_transport}' or 'auto'"
            )
        return None

    def check(self, plan: RunPlan) -> None:
        if plan.placement != "local" and (self.nnodes > 1 or self.rdzv_endpoint is not None):
            raise ValueError(
                f"trainer.hf.nnodes and rdzv_endpoint are the {plan.placement} placement's to set "
                f"(placement '{plan.placement}': slurm.trainer_nodes, slurm.rdzv_port)"
            )

    def check_resume(self, run_dir: Path, trained_steps: int) -> None:
        from orchestrator.hf.factory import check_checkpoint
        from orchestrator.hf.model import ModelError

        try:
            check_checkpoint(run_dir, trained_steps)
        except ModelError as err:
            raise ConfigError(str(err)) from None

    def start_early(self, run_dir: Path) -> StartedEarly | None:
        """The single trainer process (not torchrun's), importing torch and transformers while
        the run checks the model."""
        if self.nproc > 1 or self.nnodes > 1:
            return None
        from orchestrator.trainers.process import EarlyTrainer

        return EarlyTrainer(run_dir)

    def build(self, ctx: BuildContext) -> Trainer:
        from orchestrator.hf.factory import make_trainer  # torch, transformers: only now

        if ctx.model is None:
            raise ValueError("the hf trainer needs the run's prepared model (orchestrator.hf.factory.prepare_model)")
        return make_trainer(self, ctx, ctx.model)

"""`hf`: the transformers trainer process (full fine-tuning or LoRA; one process, or torchrun's
ranks with DDP or FSDP2) on the run's `model` dir. Its config section, `trainer.hf`; light: the
factory imports the rest (orchestrator.hf.component) only in `build`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from orchestrator.components import BuildContext, ConfigError, Section, Trainer, TrainerComponent, synthetic_envs

if TYPE_CHECKING:
    from pathlib import Path

    from orchestrator.config import RunConfig
    from orchestrator.hf.model import PreparedModel


class LoraSection(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (the update is scaled by alpha / rank)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the modules that get adapters (as PEFT matches them)",
    )


class HFTrainerConfig(TrainerComponent):
    """The transformers trainer process (full or LoRA, torchrun DDP/FSDP2): docs/hf.md."""

    resumable: ClassVar[frozenset[str]] = frozenset(
        {"nproc", "distributed", "backend", "nnodes", "node_rank", "rdzv_endpoint"}
    )
    lr: float = Field(5e-4, gt=0, description="AdamW learning rate")
    lr_warmup_steps: int = Field(5, ge=0, description="the lr ramps linearly over the first steps")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip, the ratio is clipped to [1-eps, 1+eps]")
    micro_batch_size: int = Field(
        0,
        ge=0,
        description="samples per forward/backward, gradients accumulated over "
        "a rank's share of the batch (0: the whole share at once)",
    )
    keep_weights: int = Field(
        3,
        ge=2,
        description="newest weight versions kept on disk (at least target_lag + 2, so "
        "a resume finds the version it reloads)",
    )
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapters instead of full fine-tuning")
    nproc: int = Field(1, ge=1, description="ranks per node under torchrun; 1 (one node): one process")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="how ranks share the model: DDP replicas or FSDP2 (torch.distributed.fsdp.fully_shard) shards",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process group backend (auto: nccl with CUDA, else gloo)"
    )
    nnodes: int = Field(
        1,
        ge=1,
        description="torchrun nodes; > 1 needs rdzv_endpoint and the run dir on a shared "
        "filesystem (the other nodes run the torchrun command of docs/hf.md)",
    )
    node_rank: int = Field(0, ge=0, description="this node's rank among nnodes (orch run is node 0)")
    rdzv_endpoint: str | None = Field(None, description="torchrun c10d rendezvous host:port (multi-node)")

    @model_validator(mode="after")
    def _multi_node(self) -> HFTrainerConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("trainer.hf.nnodes > 1 needs trainer.hf.rdzv_endpoint (host:port of the rendezvous)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"trainer.hf.node_rank {self.node_rank} must be < trainer.hf.nnodes {self.nnodes}")
        return self

    def check(self, run: RunConfig) -> None:
        synthetic = synthetic_envs(run)
        if synthetic:
            raise ValueError(
                f"the hf trainer learns the model's own tokens, not the {', '.join(synthetic)} env's; "
                "use trainer.kind='fake' for it"
            )

    def prepare_model(self, run: RunConfig, stored_hash: str | None) -> PreparedModel:
        from orchestrator.hf.component import prepare_model  # transformers: only now
        from orchestrator.hf.model import ModelError

        try:
            return prepare_model(run, stored_hash)
        except ModelError as err:
            raise ConfigError(str(err)) from None

    def check_resume(self, run_dir: Path, trained_steps: int) -> None:
        from orchestrator.hf.component import check_checkpoint
        from orchestrator.hf.model import ModelError

        try:
            check_checkpoint(run_dir, trained_steps)
        except ModelError as err:
            raise ConfigError(str(err)) from None

    def build(self, ctx: BuildContext) -> Trainer:
        from orchestrator.hf.component import make_trainer  # torch, transformers: only now

        if ctx.model is None:
            raise ValueError("the hf trainer needs the run's prepared model (orchestrator.hf.component.prepare_model)")
        return make_trainer(ctx.config, ctx.run_dir, ctx.model)

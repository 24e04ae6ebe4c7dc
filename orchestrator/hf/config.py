"""The `hf` trainer's settings, declared once: `TrainingSettings` (what it trains with) is part of
both the run config's section (`HFTrainerSettings`: with how its processes are started; the
component, orchestrator/hf/component.py, adds what it supports and its factory) and the trainer
process's ``RUN_DIR/trainer.json`` (`TrainerConfig`: with what the run tells it). Light: pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from orchestrator.contracts import Section
from orchestrator.hf.loss_config import LossConfig


class LoraSection(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (the update is scaled by alpha / rank)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the modules that get adapters (as PEFT matches them)",
    )


class PushSection(Section):
    """How the trainer pushes each version into the vLLM servers, when the run's weight sync is
    `vllm_push` (docs/vllm.md, "Weight push"): it holds the newest version in memory and
    broadcasts it when the orchestrator asks (its push service: RUN_DIR/weights/push.json)."""

    host: str = Field(
        "127.0.0.1",
        description="the address the push service and its groups listen on: one the servers reach "
        "(another node's servers: this node's address on their network)",
    )
    bucket_mb: float = Field(
        64.0,
        gt=0,
        description="bytes per broadcast bucket, in MiB: at least the largest tensor (checked before the run)",
    )
    transport: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="what moves the bytes: nccl between GPUs (the servers run vLLM's nccl weight-transfer "
        "backend), gloo between CPU processes (orch's orch_gloo backend); auto: what the servers orch launches "
        "receive over, else nccl where the trainer has CUDA",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="the dtype the tensors travel in (None: the trained weights' own)"
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="gloo: bound on a push group's rendezvous and on each broadcast, so a side whose peer is gone "
        "gives up (NCCL's have none: a whole push is bounded by the publish timeout)",
    )


class TrainingSettings(Section):
    """What the trainer process trains with, as the run's `trainer.hf` section gives it."""

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
    loss: LossConfig = Field(default_factory=LossConfig, description="the loss options: docs/hf.md Loss")
    min_step_time_s: float = Field(
        0.0,
        ge=0,
        description="each batch's training takes at least this long: a slowed trainer, so that batches "
        "hold samples several versions old (bench/off_policy_losses.py)",
    )
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="how ranks share the model: DDP replicas or FSDP2 (torch.distributed.fsdp.fully_shard) shards",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process group backend (auto: nccl with CUDA, else gloo)"
    )
    push: PushSection = Field(
        default_factory=PushSection, description="the weight push, used with weight_sync 'vllm_push'"
    )

    @property
    def push_bucket_bytes(self) -> int:
        return int(self.push.bucket_mb * (1 << 20))


class HFTrainerSettings(TrainingSettings):
    """The `trainer.hf` section's settings: the training ones, and how its processes are started."""

    nproc: int = Field(1, ge=1, description="ranks per node under torchrun; 1 (one node): one process")
    nnodes: int = Field(
        1,
        ge=1,
        description="torchrun nodes; > 1 needs rdzv_endpoint and the run dir on a shared "
        "filesystem (the other nodes run the torchrun command of docs/hf.md)",
    )
    node_rank: int = Field(0, ge=0, description="this node's rank among nnodes (orch run is node 0)")
    rdzv_endpoint: str | None = Field(None, description="torchrun c10d rendezvous host:port (multi-node)")

    @model_validator(mode="after")
    def _multi_node(self) -> HFTrainerSettings:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("trainer.hf.nnodes > 1 needs trainer.hf.rdzv_endpoint (host:port of the rendezvous)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"trainer.hf.node_rank {self.node_rank} must be < trainer.hf.nnodes {self.nnodes}")
        return self


class TrainerConfig(TrainingSettings):
    """``RUN_DIR/trainer.json``: the `trainer.hf` settings, and what the run tells the process."""

    model_path: Path = Field(description="the HF model dir the run starts from")
    model_hash: str = Field("", description="its model_dir_hash, kept in the checkpoint")
    max_steps: int = Field(40, ge=0, description="train on batches 1..max_steps, then exit 0")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0, description="max grad norm per optimizer step")
    seed: int = Field(0, description="seeds the LoRA A matrices' initialisation")
    batch_wait_timeout_s: float = Field(300.0, gt=0, description="bound on the wait for one batch")
    poll_interval_s: float = Field(0.02, gt=0, description="batch file polling period")
    parent_pid: int | None = Field(None, description="exit when this process dies")
    num_threads: int = Field(1, ge=1, description="torch intra-op threads per rank")
    push_weights: bool = Field(False, description="push each version into the servers (weight_sync vllm_push)")

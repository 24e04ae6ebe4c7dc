"""The trainer's checkpoint: ``trainer_ckpt/ckpt.pt``, replaced atomically after every step.

It holds what a resumed trainer needs to take exactly the step an uninterrupted one would: the
trained weights (all of them for full fine-tuning; the adapter's for LoRA: the base model comes
from model.path, whose hash the run checks on resume), the AdamW state and the step. Weights and
optimizer state are gathered as full (unsharded) state dicts keyed by parameter name, so a
checkpoint written by N ranks loads in M ranks, DDP or FSDP alike.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from orchestrator import rundir

CKPT_FORMAT = 2
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trained_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of the parameters being trained (collective under FSDP: every rank
    calls it), keyed by the unwrapped model's names."""
    state = get_model_state_dict(module, options=_FULL)
    trainable = {name for name, p in unwrapped(module).named_parameters() if p.requires_grad}
    return {name: t for name, t in state.items() if name in trainable}


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)  # DDP holds the model in .module; FSDP2 wraps in place


def save(
    run_dir: str | os.PathLike,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    model_hash: str,
    write: bool,
) -> None:
    """Gather (every rank) and write (`write`: rank 0) the checkpoint of `step`."""
    model_state = trained_state_dict(module)
    optim_state = get_optimizer_state_dict(module, optimizer, options=_FULL)
    if not write:
        return
    buf = io.BytesIO()
    torch.save(
        {"format": CKPT_FORMAT, "step": step, "model": model_state, "optimizer": optim_state, "model_hash": model_hash},
        buf,
    )
    rundir.atomic_write_bytes(path(run_dir), buf.getvalue())


def path(run_dir: str | os.PathLike) -> Path:
    return rundir.ckpt_dir(run_dir) / rundir.CKPT_FILE


def read(run_dir: str | os.PathLike) -> dict | None:
    """The checkpoint, checked (`rundir.checkpoint_damage`) before it is loaded; None if there is none. ValueError
    (one line naming the file) if it is damaged."""
    file = path(run_dir)
    if not file.is_file():
        return None
    why = rundir.checkpoint_damage(file)
    if why is not None:
        raise ValueError(f"the trainer's checkpoint {file} is {why}; restore it from a backup, or start a new run")
    return torch.load(file, map_location="cpu", weights_only=True)


def nonfinite_count(tensors) -> int:
    """How many values of `tensors` are NaN or infinite (a shard's, under FSDP: its local part)."""
    # summed where the tensors are, read back once: one device sync a scan, not one a tensor
    counts = [
        local.numel() - torch.isfinite(local.detach()).sum()
        for local in (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    ]
    return int(sum(counts)) if counts else 0


def load_weights(model: torch.nn.Module, ckpt: dict) -> None:
    """The checkpoint's trained weights into the (not yet wrapped) model; every trained
    parameter must be there."""
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    absent = sorted(trainable & set(missing))
    if absent or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {absent[:3]}, unexpected {list(unexpected)[:3]}")


def load_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict) -> None:
    set_optimizer_state_dict(module, optimizer, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))

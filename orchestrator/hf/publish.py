"""Weight versions: ``weights/step_N/`` written atomically, its ``metrics.json``, then ``STABLE``.

* full fine-tuning: an HF model dir (``save_pretrained(safe_serialization=True)`` + the tokenizer
  files), what transformers, vLLM (reload) and the in-process sampler load;
* LoRA: a PEFT adapter dir (``adapter_config.json`` + ``adapter_model.safetensors``), what vLLM's
  LoRA loader and ``PeftModel.from_pretrained`` load. Every version is one, step_0 included.

Layout and the metrics file are documented in :mod:`orchestrator.rundir`.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import torch

from orchestrator import rundir


def publish(
    run_dir: str | os.PathLike, version: int, model, tokenizer, state: dict[str, torch.Tensor], metrics: dict | None
) -> Path:
    """Write version `version` from `state` (the trained parameters' full state dict) unless it
    is already published; `model` is the unwrapped HF (or PEFT) model. Idempotent."""
    wdir = rundir.weights_dir(run_dir, version)
    if rundir.is_stable(wdir):
        return wdir
    if wdir.exists():  # a leftover without STABLE: incomplete, from an earlier crash
        rundir.remove_dir_safely(wdir)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if not is_peft(model):  # an adapter is served with its base model's tokenizer
            tokenizer.save_pretrained(tmp)
        if metrics is not None:
            (tmp / rundir.METRICS_FILE).write_bytes(orjson.dumps(metrics, option=orjson.OPT_SORT_KEYS))

    rundir.atomic_write_dir(wdir, write)
    rundir.mark_stable(wdir)
    return wdir


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def prune(run_dir: str | os.PathLike, newest: int, keep: int) -> bool:
    """Delete versions older than the newest `keep`, unless a server is loading one now (the
    versions' lock held shared, `rundir.hold_versions`): then nothing is deleted, and the next
    publish prunes them. Whether it pruned."""
    held = rundir.hold_versions(rundir.weights_dir(run_dir, newest), exclusive=True)
    if held is None:
        return False
    try:
        for version in rundir.stable_versions(run_dir):
            if version <= newest - keep:
                rundir.remove_dir_safely(rundir.weights_dir(run_dir, version))
    finally:
        rundir.release_versions(held)
    return True

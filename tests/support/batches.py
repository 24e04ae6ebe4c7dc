"""Batch files for the trainer tests, written as the orchestrator writes them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orchestrator.core.batch import BatchSample, encode_batch
from orchestrator.rundir import atomic_write_bytes, batch_path


def write_batch_file(run_dir: str | os.PathLike, step: int, samples: list[dict[str, Any]]) -> Path:
    """Write ``batches/step_{step}.safetensors`` atomically, in its canonical bytes, from samples
    given as dicts of `BatchSample`'s fields (`sample_id`, `group_id`, `env`, `policy_start` and
    `lag` default to 0 or "", `reward` to none); the orchestrator writes the bytes its log hashed
    (`orchestrator.shell.loop`)."""
    defaults = {"sample_id": 0, "group_id": 0, "env": "", "policy_start": 0, "lag": 0}
    path = batch_path(run_dir, step)
    atomic_write_bytes(path, encode_batch(step, [BatchSample(**{**defaults, **sample}) for sample in samples]))
    return path

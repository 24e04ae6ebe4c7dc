"""A resume whose log says the trainer trained N steps, but whose checkpoint is missing or
truncated, is refused before anything runs, in one line naming the file (never a silent retrain
from step 0)."""

from __future__ import annotations

import io

import pytest
import torch

from orchestrator.config import ConfigError, load_config
from orchestrator.hf.checkpoint import path as ckpt_path


def _hf_trainer():
    return load_config(None, ["trainer.kind=hf"]).trainer.chosen()


def _write_ckpt(run_dir) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": 2, "step": 3, "model": {"w": torch.zeros(64, 64)}, "optimizer": {}}, buf)
    ckpt_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    ckpt_path(run_dir).write_bytes(buf.getvalue())
    return buf.getvalue()


def test_a_missing_checkpoint_after_trained_steps_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError) as refused:
        _hf_trainer().check_resume(tmp_path, 3)
    message = str(refused.value)
    assert message.startswith(f"the trainer's checkpoint {ckpt_path(tmp_path)} is missing, but the log says")
    assert "trained up to step 3" in message and "\n" not in message


def test_a_truncated_checkpoint_is_refused_naming_it(tmp_path):
    whole = _write_ckpt(tmp_path)
    ckpt_path(tmp_path).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=f"the trainer's checkpoint {ckpt_path(tmp_path)} is damaged or truncated"):
        _hf_trainer().check_resume(tmp_path, 3)


def test_a_whole_checkpoint_or_nothing_trained_yet_passes(tmp_path):
    _hf_trainer().check_resume(tmp_path, 0)  # no checkpoint needed: the model as loaded
    _write_ckpt(tmp_path)
    _hf_trainer().check_resume(tmp_path, 3)

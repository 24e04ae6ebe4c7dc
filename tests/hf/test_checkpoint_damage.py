"""A damaged trainer checkpoint is refused before it is loaded, in one line naming it, as a missing
one is; weights a step left NaN or infinite are never checkpointed or published, and the run can
resume from the last good step."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from hf_helpers import samples, started_trainer, trainer_config

from orchestrator import rundir
from orchestrator.config import ConfigError, load_config
from orchestrator.hf import checkpoint
from orchestrator.hf.process import TrainerError, TrainerSetupError
from tests.support.batches import write_batch_file


def _train(trainer, steps: range) -> None:
    for step in steps:
        write_batch_file(trainer.run_dir, step, samples(trainer.model, trainer.tokenizer, [1.0, -1.0, 0.5, -0.5]))
        trainer.train_step(step)


@pytest.mark.parametrize("at", [3 / 7, 0.1, 0.6])
def test_a_damaged_checkpoint_is_refused_in_one_line_before_it_is_loaded(tmp_path, model_dir, at):
    config = trainer_config(model_dir)
    _train(started_trainer(tmp_path, config), range(1, 3))
    file = checkpoint.path(tmp_path)
    size = file.stat().st_size
    with open(file, "r+b") as f:  # 4 KiB of random bytes, as the trial that published NaN weights
        f.seek(int(size * at))
        f.write(random.Random(7).randbytes(4096))
    assert os.path.getsize(file) == size
    with pytest.raises(ConfigError) as refused:  # the resume's pre-flight, before anything runs
        load_config(None, ["trainer.kind=hf"]).trainer.chosen().check_resume(tmp_path, 2)
    line = str(refused.value)
    assert line.startswith(f"the trainer's checkpoint {file} is damaged") and "\n" not in line
    assert "restore it from a backup" in line
    with pytest.raises(TrainerSetupError) as at_load:  # the trainer itself (a restart) checks too
        started_trainer(tmp_path, config)
    assert str(at_load.value).startswith(f"the trainer's checkpoint {file} is damaged")


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_nonfinite_weights_are_never_checkpointed_or_published(tmp_path, model_dir, variant, monkeypatch):
    config = trainer_config(model_dir, variant)
    trainer = started_trainer(tmp_path, config)
    _train(trainer, range(1, 2))
    real = type(trainer).train_on_batch

    def train_to_nan(self, batch):  # a step whose update overflowed
        metrics = real(self, batch)
        with torch.no_grad():
            next(p for p in self.module.parameters() if p.requires_grad).view(-1)[:5] = float("nan")
        return metrics

    monkeypatch.setattr(type(trainer), "train_on_batch", train_to_nan)
    with pytest.raises(TrainerError) as refused:
        _train(trainer, range(2, 3))
    line = str(refused.value)
    assert "left 5 non-finite values" in line and "checkpoint stays at step 1" in line and "\n" not in line
    assert not rundir.weights_dir(tmp_path, 2).exists()
    assert checkpoint.read(tmp_path)["step"] == 1
    monkeypatch.undo()
    resumed = started_trainer(tmp_path, config)  # the run resumes from the last good step
    assert resumed.step == 1
    _train(resumed, range(2, 3))
    assert rundir.is_stable(rundir.weights_dir(tmp_path, 2))


def test_a_step_scans_its_weights_for_non_finite_values_once_a_republish_scans_them_too(
    tmp_path, model_dir, monkeypatch
):
    """A step checks its weights once (before its checkpoint), not again as it publishes them; a
    republish at start, whose checkpoint may predate that check, scans them."""
    config = trainer_config(model_dir)
    scans = []
    real = checkpoint.nonfinite_count

    def counted(tensors):
        scans.append(1)
        return real(tensors)

    monkeypatch.setattr(checkpoint, "nonfinite_count", counted)
    trainer = started_trainer(tmp_path, config)
    assert len(scans) == 1  # version 0, published at start
    _train(trainer, range(1, 3))
    assert len(scans) == 3 and rundir.is_stable(rundir.weights_dir(tmp_path, 2))
    shutil.rmtree(rundir.weights_dir(tmp_path, 2))  # as if the publish of step 2 never finished
    started_trainer(tmp_path, config)
    assert len(scans) == 4 and rundir.is_stable(rundir.weights_dir(tmp_path, 2))

"""trainer.hf.push: the trainer process holds each version it publishes for the weight push
(before STABLE), a resume holds its republished version too, its push service says where it
listens in RUN_DIR/weights/push.json and is gone when the loop ends; with LoRA it is refused."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from hf_helpers import samples, started_trainer, trainer_config

from orchestrator import rundir
from orchestrator.hf.config import PushSection
from tests.support.batches import write_batch_file

PUSH = PushSection(enabled=True, dtype="bfloat16")


def metadata(run_dir) -> dict:
    url = json.loads((rundir.weights_root(run_dir) / "push.json").read_text())["url"]
    with urllib.request.urlopen(url + "/metadata", timeout=30) as answer:
        return json.loads(answer.read())


def test_the_trainer_holds_each_version_it_publishes_and_a_resume_holds_its_own(tmp_path, model_dir):
    trainer = started_trainer(tmp_path, trainer_config(model_dir, push=PUSH))
    try:
        meta = metadata(tmp_path)
        trained = dict(trainer.model.named_parameters())
        assert meta["version"] == 0 and meta["names"] == list(trained)
        assert set(meta["dtype_names"]) == {"bfloat16"}
        write_batch_file(tmp_path, 1, samples(trainer.model, trainer.tokenizer, [1.0, -1.0, 0.5, -0.5]))
        trainer.train_step(1)
        assert metadata(tmp_path)["version"] == 1
        version, tensors = trainer.pusher.sender.held()
        held = dict(tensors)
        assert version == 1
        assert all(torch.equal(held[n], p.detach().bfloat16()) for n, p in trained.items())
    finally:
        trainer.pusher.close()
    assert not (rundir.weights_root(tmp_path) / "push.json").exists()
    resumed = started_trainer(tmp_path, trainer_config(model_dir, push=PUSH))  # version 1 already stable
    try:
        assert metadata(tmp_path)["version"] == 1
    finally:
        resumed.pusher.close()


def test_a_push_of_lora_adapters_is_refused():
    with pytest.raises(ValueError, match="pushes full weights"):
        trainer_config(Path("unused"), "lora", push=PUSH)

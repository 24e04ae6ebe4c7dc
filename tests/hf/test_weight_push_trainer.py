"""The hf trainer with the weight push (weight_sync vllm_push): the trainer process holds each
version it publishes (once STABLE is written), a resume holds its republished version too, its push
service says where it listens in RUN_DIR/weights/push.json and is gone when the loop ends. A
run that asks for the push of a LoRA trainer, or with buckets smaller than a tensor, is refused
in one line before it starts."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

import pytest
import torch
from hf_helpers import samples, started_trainer, trainer_config

from orchestrator import rundir
from orchestrator.contracts import ConfigError, ModelRequest
from orchestrator.hf.component import HFTrainerConfig
from orchestrator.hf.config import PushSection
from orchestrator.hf.trainer import TrainingLoop
from orchestrator.weight_push.buckets import plan_buckets, unpack
from orchestrator.weight_push.sender import PushError, WeightPushSender
from tests.support.batches import write_batch_file

PUSH = dict(push_weights=True, push=PushSection(dtype="bfloat16"))


def metadata(run_dir) -> dict:
    url = json.loads((rundir.weights_root(run_dir) / "push.json").read_text())["url"]
    with urllib.request.urlopen(url + "/metadata", timeout=30) as answer:
        return json.loads(answer.read())


def held_tensors(sender: WeightPushSender) -> tuple[int, dict[str, torch.Tensor]]:
    """The version a gloo sender holds and its tensors, unpacked from its buckets as a server
    unpacks them."""
    snapshot = sender._snapshot
    assert snapshot is not None
    plan, specs = plan_buckets(snapshot.specs, sender.bucket_bytes), snapshot.specs
    unpacked = (unpack(buffer, [specs[i] for i in bucket]) for bucket, buffer in zip(plan, snapshot.held, strict=True))
    return snapshot.version, {name: tensor for bucket in unpacked for name, tensor in bucket}


def test_the_trainer_holds_each_version_it_publishes_and_a_resume_holds_its_own(tmp_path, model_dir):
    trainer = started_trainer(tmp_path, trainer_config(model_dir, **PUSH))
    try:
        meta = metadata(tmp_path)
        trained = dict(trainer.model.named_parameters())
        assert meta["version"] == 0 and meta["names"] == list(trained)
        assert set(meta["dtype_names"]) == {"bfloat16"}
        write_batch_file(tmp_path, 1, samples(trainer.model, trainer.tokenizer, [1.0, -1.0, 0.5, -0.5]))
        trainer.train_step(1)
        assert metadata(tmp_path)["version"] == 1
        version, held = held_tensors(trainer.pusher.sender)
        assert version == 1
        assert all(torch.equal(held[n], p.detach().bfloat16()) for n, p in trained.items())
    finally:
        trainer.pusher.close()
    assert not (rundir.weights_root(tmp_path) / "push.json").exists()
    resumed = started_trainer(tmp_path, trainer_config(model_dir, **PUSH))  # version 1 already stable
    try:
        assert metadata(tmp_path)["version"] == 1
    finally:
        resumed.pusher.close()


def test_a_version_with_a_tensor_larger_than_a_bucket_is_refused(tmp_path, model_dir):
    trainer = TrainingLoop(tmp_path, trainer_config(model_dir, push_weights=True, push=PushSection(bucket_mb=0.01)))
    try:
        with pytest.raises(PushError, match="larger than a push bucket"):
            trainer.init_or_resume()
    finally:
        trainer.pusher.close()


def test_a_run_whose_buckets_are_smaller_than_a_tensor_is_refused_before_it_starts(tmp_path, model_dir):
    request = ModelRequest(path=model_dir, cache_dir=tmp_path, env_gives_messages=False, weights_pushed=True)
    section = HFTrainerConfig(push=PushSection(bucket_mb=0.01, dtype="bfloat16"))
    with pytest.raises(
        ConfigError, match=r"^trainer.hf.push.bucket_mb 0.01 is below the model's largest tensor \("
    ) as err:
        section.prepare_model(request, None)
    assert "set it to at least 1" in str(err.value)
    fits = HFTrainerConfig(push=PushSection(bucket_mb=1, dtype="bfloat16"))
    assert fits.prepare_model(request, None).path == model_dir
    assert section.prepare_model(replace(request, weights_pushed=False), None).path == model_dir  # no push: no check

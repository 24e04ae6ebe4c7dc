"""The embedded trainer writes its step's figures beside the weights, before the STABLE marker."""

import math

import orjson
from conftest import make_samples, tiny_trainer_config

from orchestrator import rundir as files
from orchestrator.embedded.policy import load_policy
from orchestrator.embedded.trainer import Trainer


def test_each_trained_step_publishes_its_metrics_the_warm_start_none(tmp_path):
    trainer = Trainer(tmp_path, tiny_trainer_config(max_steps=1), log=lambda s: None)
    trainer.init_or_resume()
    samples = make_samples(load_policy(files.weights_dir(tmp_path, 0)), 1)
    files.write_batch_file(tmp_path, 1, samples)
    stats = trainer.train_step(1)
    assert files.read_metrics(files.weights_dir(tmp_path, 0)) == (None, [])
    metrics, refused = files.read_metrics(files.weights_dir(tmp_path, 1))
    assert refused == [] and set(metrics) == set(files.TRAINER_METRICS)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["tokens"] == sum(sum(s["mask"]) for s in samples)
    assert metrics["loss"] == stats.loss and metrics["mismatch_kl"] == stats.kl
    assert metrics["learning_rate"] == trainer.lr_at(1) and metrics["entropy"] > 0
    raw = (files.weights_dir(tmp_path, 1) / files.METRICS_FILE).read_bytes()
    assert orjson.loads(raw) == metrics

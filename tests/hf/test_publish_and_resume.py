"""Published versions reload bit-identically (full: transformers; LoRA: PEFT), and a resumed
trainer takes exactly the step an uninterrupted one takes."""

from __future__ import annotations

import orjson
import pytest
import torch
from hf_helpers import samples, started_trainer, trainer_config
from transformers import AutoModelForCausalLM

from orchestrator import rundir
from tests.support.batches import write_batch_file


def _train(trainer, steps: range, advantages=(1.0, -1.0, 0.5, -0.5)) -> None:
    for step in steps:
        write_batch_file(trainer.run_dir, step, samples(trainer.model, trainer.tokenizer, list(advantages)))
        trainer.train_step(step)


def test_full_versions_are_hf_dirs_that_reload_bit_identically(tmp_path, model_dir):
    trainer = started_trainer(tmp_path, trainer_config(model_dir))
    _train(trainer, range(1, 2))
    wdir = rundir.weights_dir(tmp_path, 1)
    assert rundir.is_stable(wdir) and (wdir / "model.safetensors").is_file() and (wdir / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(wdir, dtype=torch.float32).state_dict()
    trained = trainer.model.state_dict()
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[k], trained[k]) for k in trained)
    metrics = orjson.loads((wdir / rundir.METRICS_FILE).read_bytes())
    assert metrics["step"] == 1 and metrics["tokens"] > 0 and metrics["grad_norm"] > 0
    assert {"loss", "entropy", "mismatch_kl", "lr", "step_time_s"} <= metrics.keys()


def test_lora_versions_are_peft_adapters_that_reload_bit_identically(tmp_path, model_dir):
    from peft import PeftModel

    trainer = started_trainer(tmp_path, trainer_config(model_dir, "lora"))
    step0 = rundir.weights_dir(tmp_path, 0)
    assert (step0 / "adapter_config.json").is_file() and (step0 / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 12, 40]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        at_zero = PeftModel.from_pretrained(base, step0)(input_ids=ids).logits
    assert torch.equal(plain, at_zero)  # step_0's adapter is the zero update
    _train(trainer, range(1, 2))
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), rundir.weights_dir(tmp_path, 1)
    )
    reloaded = {k: v for k, v in adapter.state_dict().items() if "lora_" in k}
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    assert reloaded.keys() == trained.keys() and trained
    assert all(torch.equal(reloaded[k], trained[k]) for k in trained)
    assert any(not torch.equal(trained[k], torch.zeros_like(trained[k])) for k in trained if "lora_B" in k)


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_a_resumed_trainer_takes_the_uninterrupted_step(tmp_path, model_dir, variant):
    config = trainer_config(model_dir, variant, lr_warmup_steps=2)
    straight = started_trainer(tmp_path / "straight", config)
    _train(straight, range(1, 3))
    interrupted = started_trainer(tmp_path / "resumed", config)
    _train(interrupted, range(1, 2))
    resumed = started_trainer(tmp_path / "resumed", config)  # a new process: from the checkpoint
    assert resumed.step == 1
    _train(resumed, range(2, 3))
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the AdamW moments came back too: a fresh optimizer would have taken another step
    fresh = started_trainer(tmp_path / "fresh", config)
    fresh.model.load_state_dict(interrupted.model.state_dict())
    fresh.step = 1
    _train(fresh, range(2, 3))
    assert any(not torch.equal(a[k], fresh.model.state_dict()[k]) for k in a)


def test_a_checkpoint_of_another_model_is_refused(tmp_path, model_dir):
    from orchestrator.hf.process import TrainerSetupError

    started_trainer(tmp_path, trainer_config(model_dir, model_hash="a" * 64))
    with pytest.raises(TrainerSetupError, match="another model"):
        started_trainer(tmp_path, trainer_config(model_dir, model_hash="b" * 64))

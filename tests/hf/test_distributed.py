"""N ranks under torchrun (gloo, CPU) take the update one process takes: DDP and FSDP2, full
fine-tuning and LoRA, whole shares and micro-batches."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hf_helpers import samples, trainer_config
from safetensors.torch import load_file

from orchestrator import rundir
from orchestrator.hf.distributed import torchrun_command
from orchestrator.hf.trainer import run_trainer, write_trainer_config
from orchestrator.rundir import write_batch_file

REPO = Path(__file__).resolve().parents[2]


def _weights(run_dir, version: int) -> dict[str, torch.Tensor]:
    wdir = rundir.weights_dir(run_dir, version)
    name = "adapter_model.safetensors" if (wdir / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(wdir / name)


def _prepare(run_dir, model_dir, variant: str, distributed: str, batches: list[list[dict]], micro: int = 0) -> None:
    write_trainer_config(
        run_dir,
        trainer_config(
            model_dir,
            variant,
            max_steps=len(batches),
            distributed=distributed,
            backend="gloo",
            lr=1e-3,
            micro_batch_size=micro,
        ),
    )
    for step, batch in enumerate(batches, 1):
        write_batch_file(run_dir, step, batch)


def test_micro_batches_take_the_whole_batch_update(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    batches = [samples(model, tokenizer, [1.0, -0.5, 0.25, -1.0, 0.5])]
    _prepare(tmp_path / "whole", model_dir, "full", "ddp", batches)
    _prepare(tmp_path / "micro", model_dir, "full", "ddp", batches, micro=2)  # 2 + 2 + 1 samples
    assert run_trainer(tmp_path / "whole") == 0 and run_trainer(tmp_path / "micro") == 0
    a, b = _weights(tmp_path / "whole", 1), _weights(tmp_path / "micro", 1)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5  # float rounding through AdamW
    assert max(float((a[k] - _weights(tmp_path / "whole", 0)[k]).abs().max()) for k in a) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant, distributed, micro", [("full", "ddp", 2), ("full", "fsdp", 2), ("lora", "ddp", 0), ("lora", "fsdp", 0)]
)
def test_two_gloo_ranks_take_the_single_process_update(tmp_path, model_dir, variant, distributed, micro, capsys):
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    # 5 samples: the ranks get 3 and 2 of them, and different token counts
    batches = [samples(model, tokenizer, [1.0, -0.5, 0.25, -1.0, 0.5]), samples(model, tokenizer, [-1.0, 1.0, 0.5])]
    one, two = tmp_path / "one", tmp_path / "two"
    _prepare(one, model_dir, variant, distributed, batches)
    _prepare(two, model_dir, variant, distributed, batches, micro)  # the ranks' micro-batches: 2 + 1 and 2
    assert run_trainer(one) == 0
    ranks = subprocess.run(torchrun_command(two, nproc=2), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    log = ranks.stdout
    assert f"2 rank(s) (gloo, cpu, {distributed})" in log and log.count("ranks=2") == 2
    for version in (1, 2):
        a, b = _weights(one, version), _weights(two, version)
        assert a.keys() == b.keys()
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        with capsys.disabled():
            print(f"\n{variant} {distributed}: version {version}, 2 ranks vs 1 process, max |dw| {worst:.1e}")
        assert worst < 1e-5, f"version {version}: max |difference| {worst:.2e}"
    moved = max(float((_weights(one, 2)[k] - _weights(one, 0)[k]).abs().max()) for k in a)
    assert moved > 1e-4  # the comparison is between real updates, not two copies of step 0

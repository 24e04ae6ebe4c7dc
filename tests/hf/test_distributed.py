"""N ranks under torchrun (gloo, CPU) take the update one process takes: DDP and FSDP2, full
fine-tuning and LoRA, whole shares and micro-batches."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest
import torch
from hf_helpers import samples, trainer_config
from safetensors.torch import load_file

from orchestrator import rundir
from orchestrator.hf.distributed import torchrun_command
from orchestrator.hf.loss_config import LossConfig
from orchestrator.hf.trainer import run_trainer, write_trainer_config
from tests.support.batches import write_batch_file

REPO = Path(__file__).resolve().parents[2]


def _weights(run_dir, version: int) -> dict[str, torch.Tensor]:
    wdir = rundir.weights_dir(run_dir, version)
    name = "adapter_model.safetensors" if (wdir / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(wdir / name)


def _prepare(
    run_dir, model_dir, variant: str, distributed: str, batches: list[list[dict]], micro: int = 0, **loss
) -> None:
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
            loss=LossConfig(**loss),
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


def test_a_rank_that_sees_the_version_already_published_still_publishes_with_the_others(tmp_path, model_dir):
    """Rank 1 of two looks at each version's weights only after the main rank made them STABLE
    (tests/hf/late_rank.py): the ranks still decide together whether to publish, so both reach
    the same collectives, and the run ends rather than waiting in a barrier rank 1 skipped."""
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    batches = [samples(model, tokenizer, [1.0, -0.5, 0.25, -1.0]), samples(model, tokenizer, [-1.0, 1.0])]
    _prepare(tmp_path, model_dir, "full", "ddp", batches)
    command = torchrun_command(tmp_path, nproc=2)
    at = command.index("orchestrator.cli")
    command[at] = "tests.hf.late_rank"
    ranks = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert "late_rank: rank 1" in ranks.stdout and ranks.stdout.count("ranks=2") == 2
    assert rundir.stable_versions(tmp_path) == [0, 1, 2]


def _off_policy(rows: list[dict], shift: float) -> list[dict]:
    """The samples as if drawn by a policy `shift` nats away on alternate tokens."""
    for row in rows:
        row["logprobs"] = [
            min(0.0, lp + (shift if k % 2 else -shift)) if m else 0.0
            for k, (lp, m) in enumerate(zip(row["logprobs"], row["mask"]))
        ]
    return rows


# Each correction once, with the other options spread over them; micro-batches and mini-batches
# in every case (5 samples: the ranks get 3 and 2 of each batch, mini-batches of 3 and 2).
LOSS_OPTIONS = {
    "none-asym-clip-epochs": ("full", dict(clip_low=0.1, clip_high=0.3, mini_batches=2, epochs=2)),
    "tis-seq-mean-token-mean": ("full", dict(correction="tis", aggregation="seq-mean-token-mean", mini_batches=2)),
    "seq_tis-seq-mean-token-sum": ("full", dict(correction="seq_tis", aggregation="seq-mean-token-sum")),
    "icepop-constant": ("full", dict(correction="icepop", aggregation="constant", normalizer=8.0, mini_batches=2)),
    "seq_mask-gspo": ("full", dict(correction="seq_mask", ratio_level="sequence", mask_high=1.2)),
    "decoupled-no-clip": ("full", dict(correction="decoupled", clip="none", mini_batches=2, epochs=2)),
    "kl-k3-full": ("full", dict(kl_reference="initial", kl_coef=0.5, mini_batches=2)),
    "kl-k1-lora": ("lora", dict(kl_reference="initial", kl_coef=0.5, kl_estimator="k1", mini_batches=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOSS_OPTIONS))
def test_two_gloo_ranks_take_the_single_process_update_with_each_loss_option(tmp_path, model_dir, case):
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    variant, loss = LOSS_OPTIONS[case]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    batches = [
        _off_policy(samples(model, tokenizer, [1.0, -0.5, 0.25, -1.0, 0.5]), 0.4),
        _off_policy(samples(model, tokenizer, [-1.0, 1.0, 0.5, 0.75, -0.25]), 0.2),
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    _prepare(one, model_dir, variant, "ddp", batches, 2, **loss)
    _prepare(two, model_dir, variant, "ddp", batches, 1, **loss)  # other micro-batches, same update
    assert run_trainer(one) == 0
    ranks = subprocess.run(torchrun_command(two, nproc=2), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    for version in (1, 2):
        a, b = _weights(one, version), _weights(two, version)
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        # AdamW's first steps move a weight by ~lr (1e-3) whatever its gradient's size, so float32
        # rounding of the ranks' sums in a near-zero gradient shows up here amplified (seen: 1.3e-5
        # with GSPO's exp of a mean); a wrong normaliser or mask differs by ~lr.
        assert worst < 5e-5, f"{case}: version {version}: max |difference| {worst:.2e}"
        m1, m2 = (orjson.loads((rundir.weights_dir(r, version) / rundir.METRICS_FILE).read_bytes()) for r in (one, two))
        for key in ("loss", "clipfrac", "is_weight_mean", "truncated_frac", "masked_frac", "mismatch_kl", "kl_ref"):
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        assert m1["optimizer_steps"] == m2["optimizer_steps"] == loss.get("mini_batches", 1) * loss.get("epochs", 1)
    moved = max(float((_weights(one, 2)[k] - _weights(one, 0)[k]).abs().max()) for k in a)
    assert moved > 1e-4

"""trainer.hf.loss (docs/hf.md "Loss"): each formula against values computed here by hand on small
tensors, gradients by torch.autograd.gradcheck in float64 where the formula is smooth, the
defaults bit-identical to the loss the trainer always had, a fully masked batch trains nothing,
and bad options are one line before anything runs."""

from __future__ import annotations

import math

import pytest
import torch
from hf_helpers import samples, started_trainer, trainer_config

from orchestrator.core.batch import BatchSample, encode_batch
from orchestrator.hf.batch import parse_batch
from orchestrator.hf.loss import Counts, policy_loss
from orchestrator.hf.loss_config import LossConfig

# One row of 4 positions, 3 sampled tokens (position 0 is the prompt's); a second row of 2.
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
SAMPLER = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.5, -0.7, 0.0]], dtype=torch.float64)
# log ratios to the sampler on the sampled tokens: row 0: 0.1, -0.4, 0.9; row 1: 0.05, -0.1
LOG_R = torch.tensor([[0.0, 0.1, -0.4, 0.9], [0.0, 0.05, -0.1, 0.0]], dtype=torch.float64)
ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)
COUNTS = Counts(tokens=5, samples=2)


def _new(log_r=LOG_R) -> torch.Tensor:
    return (SAMPLER + log_r).clone().requires_grad_(True)


def _loss(config: LossConfig, new=None, clip_eps=0.2, **kw):
    new = _new() if new is None else new
    loss, stats = policy_loss(new, SAMPLER, ADV, MASK, clip_eps, config, COUNTS, **kw)
    loss.backward()
    return float(loss.detach()), new.grad, stats


def _tokens(values) -> list[float]:
    """The 5 sampled tokens' entries, in order."""
    return [float(values[i, j]) for i, j in [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]]


E = math.exp
TOKENS_A = [1.0, 1.0, 1.0, -2.0, -2.0]
TOKENS_R = [E(0.1), E(-0.4), E(0.9), E(0.05), E(-0.1)]


def test_default_ppo_with_an_asymmetric_clip():
    low, high = 0.2, 0.3
    loss, grad, stats = _loss(LossConfig(clip_low=low, clip_high=high))
    # A=+1: min(r, clip(r)); A=-2: max(r, clip(r)) * 2 (pessimistic side)
    expected = []
    for r, a in zip(TOKENS_R, TOKENS_A):
        c = min(max(r, 1 - low), 1 + high)
        expected.append(-min(r * a, c * a))
    assert loss == pytest.approx(sum(expected) / 5, rel=1e-12)
    # gradient: -r A / 5 where the unclipped term is the min, else 0
    want = [(-r * a / 5 if r * a <= min(max(r, 1 - low), 1 + high) * a else 0.0) for r, a in zip(TOKENS_R, TOKENS_A)]
    assert _tokens(grad) == pytest.approx(want, rel=1e-12)
    # ratios outside [0.8, 1.3]: e^-0.4 = 0.670 and e^0.9 = 2.46
    assert stats["clipped"] == 2


def test_no_clip_is_the_plain_importance_weighted_gradient():
    loss, grad, _ = _loss(LossConfig(clip="none"))
    assert loss == pytest.approx(-sum(r * a for r, a in zip(TOKENS_R, TOKENS_A)) / 5, rel=1e-12)
    assert _tokens(grad) == pytest.approx([-r * a / 5 for r, a in zip(TOKENS_R, TOKENS_A)], rel=1e-12)


def test_gspo_uses_the_geometric_mean_ratio_of_each_sample():
    loss, grad, stats = _loss(LossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean", clip="none"))
    s0, s1 = E((0.1 - 0.4 + 0.9) / 3), E((0.05 - 0.1) / 2)
    # seq-mean-token-mean of -s_i A_i (every token of a row holds its row's ratio)
    assert loss == pytest.approx((-s0 * 1.0 - s1 * -2.0) / 2, rel=1e-12)
    # d/dlogp_t of -s_i A_i / 2 = -s_i A_i / (2 n_i)
    want = [-s0 / 6] * 3 + [s1 * 2 / 4] * 2
    assert _tokens(grad) == pytest.approx(want, rel=1e-12)
    assert stats["ratio_max"] == pytest.approx(s0, rel=1e-12)


def test_tis_truncates_the_weight_at_c_inside_the_clip_region():
    cut = 1.5
    _, grad, stats = _loss(LossConfig(correction="tis", truncate_at=cut))
    # gate: A=+1 tokens with r > 1.2 get no gradient (e^0.9); A=-2 with r < 0.8: none here
    weights = [min(r, cut) for r in TOKENS_R]
    gates = [0.0 if (a > 0 and r > 1.2) or (a < 0 and r < 0.8) else 1.0 for r, a in zip(TOKENS_R, TOKENS_A)]
    assert _tokens(grad) == pytest.approx([-w * g * a / 5 for w, g, a in zip(weights, gates, TOKENS_A)], rel=1e-12)
    assert stats["truncated"] == 1 and stats["weight_max"] == pytest.approx(cut)
    assert stats["weight"] == pytest.approx(sum(weights), rel=1e-12)


def test_tis_with_an_advantage_against_a_large_ratio_caps_its_weight():
    log_r = LOG_R.clone()
    log_r[1, 1] = 1.5  # r = e^1.5 = 4.48 on a token of A = -2: PPO keeps the unclipped r A
    _, ppo_grad, _ = _loss(LossConfig(), new=_new(log_r))
    _, tis_grad, _ = _loss(LossConfig(correction="tis", truncate_at=2.0), new=_new(log_r))
    assert float(ppo_grad[1, 1]) == pytest.approx(E(1.5) * 2 / 5, rel=1e-12)
    assert float(tis_grad[1, 1]) == pytest.approx(2.0 * 2 / 5, rel=1e-12)


def test_seq_tis_weights_every_token_by_the_truncated_product_of_its_row():
    cut = 1.5
    _, grad, stats = _loss(LossConfig(correction="seq_tis", truncate_at=cut, clip="none"))
    w0, w1 = min(E(0.1 - 0.4 + 0.9), cut), min(E(0.05 - 0.1), cut)  # e^0.6 = 1.82 -> 1.5; e^-0.05
    assert _tokens(grad) == pytest.approx([-w0 / 5] * 3 + [w1 * 2 / 5] * 2, rel=1e-12)
    assert stats["truncated"] == 3


def test_icepop_masks_the_tokens_outside_the_band():
    _, grad, stats = _loss(LossConfig(correction="icepop", mask_low=0.7, mask_high=2.0, clip="none"))
    # e^-0.4 = 0.670 < 0.7 and e^0.9 = 2.46 > 2: masked; the others keep r
    want = [-E(0.1) / 5, 0.0, 0.0, E(0.05) * 2 / 5, E(-0.1) * 2 / 5]
    assert _tokens(grad) == pytest.approx(want, rel=1e-12)
    assert stats["masked"] == 2 and stats["kept"] == 3


def test_seq_mask_drops_whole_samples_by_their_geometric_mean_ratio():
    _, grad, stats = _loss(LossConfig(correction="seq_mask", mask_low=0.5, mask_high=1.15, clip="none"))
    # row 0: e^(0.6/3) = 1.22 > 1.15: masked; row 1: e^(-0.025) kept, weights r
    want = [0.0, 0.0, 0.0, E(0.05) * 2 / 5, E(-0.1) * 2 / 5]
    assert _tokens(grad) == pytest.approx(want, rel=1e-12)
    assert stats["masked"] == 3


def test_decoupled_clips_against_the_old_policy_and_weights_by_old_over_sampler():
    old_log_r = torch.tensor([[0.0, 0.3, -0.2, 0.2], [0.0, 1.2, 0.0, 0.0]], dtype=torch.float64)
    old = SAMPLER + old_log_r
    cut = 3.0
    loss, grad, stats = _loss(LossConfig(correction="decoupled", truncate_at=cut), old_logprobs=old)
    expected, want = [], []
    for (i, j), a in zip([(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)], TOKENS_A):
        r = E(float(LOG_R[i, j] - old_log_r[i, j]))
        w = min(E(float(old_log_r[i, j])), cut)
        c = min(max(r, 0.8), 1.2)
        expected.append(-w * min(r * a, c * a))
        want.append(-w * r * a / 5 if r * a <= c * a else 0.0)
    assert loss == pytest.approx(sum(expected) / 5, rel=1e-12)
    assert _tokens(grad) == pytest.approx(want, rel=1e-12)
    assert stats["truncated"] == 1  # e^1.2 = 3.32 > 3


@pytest.mark.parametrize(
    "aggregation, normalizer, weights",
    [
        ("token-mean", 0.0, [1 / 5] * 5),
        ("seq-mean-token-mean", 0.0, [1 / 6] * 3 + [1 / 4] * 2),
        ("seq-mean-token-sum", 0.0, [1 / 2] * 5),
        ("constant", 4.0, [1 / 8] * 5),
    ],
)
def test_each_aggregation_divides_as_documented(aggregation, normalizer, weights):
    loss, grad, _ = _loss(LossConfig(aggregation=aggregation, normalizer=normalizer, clip="none"))
    assert loss == pytest.approx(sum(-r * a * w for r, a, w in zip(TOKENS_R, TOKENS_A, weights)), rel=1e-12)
    assert _tokens(grad) == pytest.approx([-r * a * w for r, a, w in zip(TOKENS_R, TOKENS_A, weights)], rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_reference_kl_is_added_with_its_coefficient(estimator):
    ref = SAMPLER + torch.tensor([[0.0, 0.2, 0.0, -0.3], [0.0, 0.0, 0.4, 0.0]], dtype=torch.float64)
    config = LossConfig(kl_reference="initial", kl_estimator=estimator, kl_coef=0.5, clip="none")
    loss, grad, stats = _loss(config, ref_logprobs=ref)
    base, _, _ = _loss(LossConfig(clip="none"))
    kls, dkl = [], []
    for i, j in [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]:
        d = float(ref[i, j] - (SAMPLER[i, j] + LOG_R[i, j]))  # log ref - log theta
        kls.append(-d if estimator == "k1" else E(d) - d - 1)
        dkl.append(1.0 if estimator == "k1" else 1 - E(d))  # d kl / d log theta
    assert loss == pytest.approx(base + 0.5 * sum(kls) / 5, rel=1e-12)
    assert stats["kl_ref"] == pytest.approx(sum(kls), rel=1e-12)
    policy = [-r * a / 5 for r, a in zip(TOKENS_R, TOKENS_A)]
    assert _tokens(grad) == pytest.approx([p + 0.5 * k / 5 for p, k in zip(policy, dkl)], rel=1e-12)


@pytest.mark.parametrize(
    "config, extra",
    [
        (LossConfig(clip="none"), {}),
        (LossConfig(clip_low=0.3, clip_high=0.5), {}),  # every ratio strictly inside or outside
        (LossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean"), {}),
        (LossConfig(aggregation="seq-mean-token-sum", clip="none"), {}),
        (LossConfig(aggregation="constant", normalizer=3.0, clip="none"), {}),
        (LossConfig(correction="decoupled", clip="none"), {"old": True}),
        (LossConfig(kl_reference="initial", kl_coef=0.3, kl_estimator="k3", clip="none"), {"ref": True}),
        (LossConfig(kl_reference="initial", kl_coef=0.3, kl_estimator="k1"), {"ref": True}),
    ],
)
def test_smooth_losses_pass_gradcheck_in_float64(config, extra):
    old = SAMPLER + 0.1 if extra.get("old") else None
    ref = SAMPLER - 0.2 if extra.get("ref") else None

    def f(new):
        return policy_loss(new, SAMPLER, ADV, MASK, 0.2, config, COUNTS, old_logprobs=old, ref_logprobs=ref)[0]

    assert torch.autograd.gradcheck(f, (_new(),), eps=1e-6, atol=1e-8)


def _batch(model, tokenizer, advantages, shift=0.0, step=1, alternate=True):
    rows = samples(model, tokenizer, advantages)
    for row in rows:  # sampled by a policy `shift` away from the trainer's (alternating sign)
        row["logprobs"] = [
            min(0.0, lp + (shift if k % 2 and alternate else -shift)) if m else 0.0
            for k, (lp, m) in enumerate(zip(row["logprobs"], row["mask"]))
        ]
    return encode_batch(step, [BatchSample(**row) for row in rows])


def _todays_pg_loss(new_logprobs, old_logprobs, advantages, mask, clip_eps, n_tokens):
    """The loss as the trainer had it before trainer.hf.loss, verbatim."""
    mask_f = mask.to(new_logprobs.dtype)
    n = torch.tensor(float(n_tokens)).clamp(min=1.0)
    log_ratio = torch.where(mask, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype).view(-1, 1).expand_as(ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    return -(torch.minimum(unclipped, clipped) * mask_f).sum() / n


def _todays_step(trainer, batch):
    """The optimizer step as the trainer took it before trainer.hf.loss (one process)."""
    from orchestrator.hf.loss import token_logprobs
    from orchestrator.hf.trainer import full_value

    total = batch.n_tokens
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.module.train()
    for chunk in trainer.ranks.shard(batch, trainer.config.micro_batch_size):
        logits = trainer.module(input_ids=chunk.ids, attention_mask=chunk.attention).logits
        new_lp, _ = token_logprobs(logits, chunk.ids, chunk.temperature)
        loss = _todays_pg_loss(
            new_lp, chunk.sampler_logprobs, chunk.advantages, chunk.mask, trainer.config.clip_eps, total
        )
        (loss * 1).backward()
    full_value(torch.nn.utils.clip_grad_norm_(trainer.module.parameters(), trainer.config.grad_clip))
    for group in trainer.optimizer.param_groups:
        group["lr"] = trainer.lr_at(batch.step)
    trainer.optimizer.step()
    trainer.module.eval()


@pytest.mark.parametrize("variant, micro", [("full", 0), ("full", 2), ("lora", 2)])
def test_the_defaults_take_bit_for_bit_the_update_of_the_loss_before_the_options(tmp_path, model_dir, variant, micro):
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    config = trainer_config(model_dir, variant, micro_batch_size=micro)
    now, before = started_trainer(tmp_path / "now", config), started_trainer(tmp_path / "before", config)
    for step, shift in [(1, 0.3), (2, 0.1)]:  # off-policy: the clip is active
        raw = _batch(model, tokenizer, [1.0, -0.5, 0.25, -1.0, 0.5], shift, step)
        metrics = now.train_on_batch(parse_batch(raw, step, now.vocab_size))
        _todays_step(before, parse_batch(raw, step, before.vocab_size))
        assert metrics["clipfrac"] > 0 and metrics["optimizer_steps"] == 1
    a, b = now.module.state_dict(), before.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    moved = dict(started_trainer(tmp_path / "fresh", config).module.state_dict())
    assert any(not torch.equal(a[k], moved[k]) for k in a)


def test_a_fully_masked_batch_trains_nothing_and_says_so(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    lines: list[str] = []
    config = trainer_config(model_dir, "full", loss=LossConfig(correction="icepop", mask_low=0.5, mask_high=2.0))
    trainer = started_trainer(tmp_path / "run", config)
    trainer._log = lines.append
    first = trainer.train_on_batch(parse_batch(_batch(model, tokenizer, [1.0, -1.0]), 1, trainer.vocab_size))
    assert first["optimizer_steps"] == 1 and first["masked_frac"] == 0.0  # AdamW now has moments
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    # sampled 1 nat below the trained weights: every ratio is e > mask_high
    raw = _batch(trainer.model, tokenizer, [1.0, -1.0, 0.5], shift=1.0, step=2, alternate=False)
    metrics = trainer.train_on_batch(parse_batch(raw, 2, trainer.vocab_size))
    assert metrics["masked_frac"] == 1.0 and metrics["skipped_steps"] == 1 and metrics["optimizer_steps"] == 0
    assert metrics["is_weight_mean"] == 0.0 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in trainer.module.state_dict().items())
    assert any("every sampled token was masked; weights unchanged" in line for line in lines)


def test_mini_batches_and_epochs_take_several_steps_and_the_clip_bites(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    from orchestrator.hf.tiny_model import build_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), build_tokenizer()
    config = trainer_config(model_dir, "full", loss=LossConfig(mini_batches=2, epochs=2, correction="decoupled"))
    trainer = started_trainer(tmp_path / "run", config)
    raw = _batch(model, tokenizer, [1.0, -0.5, 0.25, -1.0, 0.5], shift=0.2)
    metrics = trainer.train_on_batch(parse_batch(raw, 1, trainer.vocab_size))
    assert metrics["optimizer_steps"] == 4
    # decoupled: the first step's ratio to the old policy is 1; later ones moved past the clip
    assert metrics["clipfrac_max"] > 0 and metrics["clipfrac"] < metrics["clipfrac_max"]
    assert metrics["mismatch_kl"] > 0 and metrics["is_weight_mean"] > 0


@pytest.mark.parametrize(
    "sets, message",
    [
        (["trainer.hf.loss.correction=bogus"], "trainer.hf.loss.correction"),
        (["trainer.hf.loss.mask_low=2", "trainer.hf.loss.mask_high=1"], "mask_low 2.0 must be < mask_high 1.0"),
        (["trainer.hf.loss.kl_coef=0.1"], "kl_coef > 0 needs a reference"),
        (["trainer.hf.loss.aggregation=constant"], "needs trainer.hf.loss.normalizer > 0"),
        (["trainer.hf.loss.tis=1"], "trainer.hf.loss.tis"),
        (
            ["trainer.kind=fake", 'envs={"fake": 1}', "trainer.hf.loss.correction=tis"],
            "trainer.hf.loss.correction is an option of the hf trainer; trainer.kind='fake' has no loss",
        ),
    ],
)
def test_bad_loss_options_are_one_line_before_anything_runs(tmp_path, sets, message):
    from click.testing import CliRunner

    from orchestrator.cli import main

    args = ["run", "--runs-dir", str(tmp_path / "runs"), "--name", "r"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(main, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(lines) == 1 and lines[0].startswith("orch: error: ") and message in lines[0], lines
    assert not (tmp_path / "runs" / "r").exists()

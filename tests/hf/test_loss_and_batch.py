"""The loss and the batch schema every trainer shares: the default loss's values and gradients, and the
same suite of batches (good and bad) run on each trainer variant."""

from __future__ import annotations

import re

import orjson
import pytest
import torch
from hf_helpers import VARIANTS, samples, started_trainer, trainer_config

from orchestrator.core.batch import BatchSample, encode_batch
from orchestrator.hf.batch import BatchError, parse_batch
from orchestrator.hf.loss import Counts, policy_loss, token_logprobs
from orchestrator.hf.loss_config import LossConfig
from orchestrator.hf.process import TrainerError
from tests.support.batches import write_batch_file

VOCAB = 300


def _raw(sample_list, step=1) -> bytes:
    defaults = {"sample_id": 0, "group_id": 0, "env": "", "policy_start": 0, "lag": 0}
    return encode_batch(step, [BatchSample(**{**defaults, **sample}) for sample in sample_list])


def pg_loss(new, sampler, advantages, mask, clip_eps):
    """The default loss (`trainer.hf.loss` unset) of these rows, with its clip fraction and
    mismatch KL as token means."""
    counts = Counts.of(mask)
    loss, stats = policy_loss(new, sampler, advantages, mask, clip_eps, LossConfig(), counts)
    n = max(counts.tokens, 1)
    return loss, {"clipfrac": stats["clipped"] / n, "mismatch_kl": stats["mismatch_k3"] / n}


def test_zero_advantage_gives_zero_gradient():
    new = torch.zeros(2, 4, requires_grad=True)
    loss, _ = pg_loss(new, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 4, dtype=torch.bool), 0.2)
    loss.backward()
    assert torch.count_nonzero(new.grad) == 0


def test_loss_value_and_gradient_at_ratio_one():
    new = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    loss, info = pg_loss(new, new.detach().clone(), adv, mask, 0.2)
    assert float(loss.detach()) == pytest.approx(-(2 + 2 - 1) / 3)  # -mean of per-token advantages
    loss.backward()
    expected = -torch.tensor([[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]]) / 3  # d/dlogp of ratio*A at ratio 1
    assert torch.allclose(new.grad, expected)
    assert info["clipfrac"] == 0.0 and info["mismatch_kl"] == 0.0


def test_ratio_clipping_zeros_gradient_beyond_the_clip():
    eps = 0.2
    old = torch.zeros(1, 6)
    log_ratio = torch.tensor([[0.0, 0.05, 0.5, -0.5, 0.5, -0.5]])  # inside, above 1+eps, below 1-eps
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for adv, zero_cols, live_cols in [(1.0, [2], [1, 3]), (-1.0, [3], [1, 2])]:
        new = log_ratio.clone().requires_grad_(True)
        loss, info = pg_loss(new, old, torch.tensor([adv]), mask, eps)
        loss.backward()
        grad = new.grad[0]
        assert all(grad[c] == 0.0 for c in zero_cols)  # pushed beyond the clip the advantage's way
        assert all(grad[c] != 0.0 for c in live_cols)  # inside the clip, or the pessimistic side
        assert grad[0] == 0.0  # masked token
        assert info["clipfrac"] == pytest.approx(4 / 5)


def test_mismatch_kl_is_the_k3_estimate():
    new, old = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -1.1, -1.8]])
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    _, info = pg_loss(new, old, torch.ones(1), mask, 0.2)
    log_r = torch.tensor([0.1, -0.2])
    assert info["mismatch_kl"] == pytest.approx(float(((log_r.exp() - 1) - log_r).mean()), rel=1e-5)


def test_token_logprobs_are_the_temperature_scaled_log_softmax():
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    temps = torch.tensor([1.0, 0.5])
    lp, entropy = token_logprobs(logits, ids, temps)
    row, t = 1, 2
    expected = torch.log_softmax(logits[row, t - 1] / 0.5, -1)
    assert lp[row, t] == pytest.approx(float(expected[ids[row, t]]), abs=1e-6)
    assert entropy[row, t] == pytest.approx(float(-(expected.exp() * expected).sum()), abs=1e-5)
    assert lp[:, 0].eq(0).all()


GOOD = {
    "token_ids": [1, 2, 3],
    "mask": [0, 1, 1],
    "logprobs": [0.0, -0.5, -1.0],
    "advantage": 0.5,
    "temperature": 1.0,
    "sample_id": 7,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"token_ids": [1], "mask": [0], "logprobs": [0.0]}, "fewer than 2 tokens"),
        ({"mask": [1, 1, 1]}, "mask[0] == 0"),
        ({"token_ids": [1, 2, VOCAB]}, "vocabulary"),
        ({"logprobs": [0.0, 0.5, -1.0]}, "<= 0"),
        ({"advantage": float("nan")}, "finite"),
        ({"temperature": 0}, "> 0"),
    ],
)
def test_a_bad_sample_is_named(change, message):
    with pytest.raises(BatchError, match=re.escape(message)) as err:
        parse_batch(_raw([GOOD, GOOD | change]), 1, VOCAB)
    assert "sample 1 (sample_id 7)" in str(err.value)


def test_a_file_that_is_no_batch_and_a_wrong_step_are_named():
    with pytest.raises(BatchError, match="batch: not a safetensors file"):
        parse_batch(orjson.dumps({"format": 1, "step": 1, "samples": [GOOD]}), 1, VOCAB)
    with pytest.raises(BatchError, match="step must be 2"):
        parse_batch(_raw([GOOD], step=1), 2, VOCAB)


def test_ragged_samples_are_right_padded_with_an_attention_mask():
    batch = parse_batch(
        _raw(
            [
                GOOD,
                GOOD
                | {"token_ids": [4, 5, 6, 7], "mask": [0, 0, 1, 1], "logprobs": [0.0, 0.0, -1.0, -2.0], "reward": 1.0},
            ]
        ),
        1,
        VOCAB,
    )
    assert batch.ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert batch.attention.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.n_tokens == 4 and batch.rewards is None  # not every sample has a reward


# ------------------------------------------------------------------ the same suite on each trainer
@pytest.fixture(params=sorted(VARIANTS))
def trainer(request, tmp_path, model_dir):
    return started_trainer(tmp_path, trainer_config(model_dir, request.param))


def _sampled_logprob_sum(trainer, sample_list) -> float:
    batch = parse_batch(_raw(sample_list), 1, trainer.vocab_size)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.ids, attention_mask=batch.attention).logits
        lp, _ = token_logprobs(logits, batch.ids, batch.temperature)
    return float((lp * batch.mask).sum())


@pytest.mark.parametrize("advantage, direction", [(1.0, +1), (-1.0, -1)])
def test_each_trainer_moves_sampled_logprobs_the_advantage_way(trainer, advantage, direction):
    batch = samples(trainer.model, trainer.tokenizer, [advantage] * 4)
    before = _sampled_logprob_sum(trainer, batch)
    write_batch_file(trainer.run_dir, 1, batch)
    metrics = trainer.train_step(1)
    assert direction * (_sampled_logprob_sum(trainer, batch) - before) > 1e-3
    assert metrics["tokens"] == sum(sum(s["mask"]) for s in batch) and metrics["samples"] == 4
    assert metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)  # sampled by these very weights
    assert metrics["loss"] == pytest.approx(-advantage, rel=1e-5)  # ratio 1: -mean advantage


def test_each_trainer_refuses_a_bad_batch_naming_it(trainer):
    write_batch_file(trainer.run_dir, 1, [GOOD | {"token_ids": [1, 2, 10_000]}])
    with pytest.raises(TrainerError, match="sample 0 .*vocabulary"):
        trainer.train_step(1)


def test_each_trainer_leaves_weights_alone_on_a_batch_without_sampled_tokens(trainer):
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    write_batch_file(trainer.run_dir, 1, [GOOD | {"mask": [0, 0, 0]}])
    metrics = trainer.train_step(1)
    assert metrics["tokens"] == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_each_samples_loss_weight_scales_its_rows_share():
    """An episode's two samples at weight 1/2 each weigh what its one sample at 1 would."""
    new = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    weights = torch.tensor([0.5, 1.0])
    loss, _ = policy_loss(
        new, new.detach().clone(), adv, mask, 0.2, LossConfig(), Counts.of(mask), sample_weights=weights
    )
    assert float(loss.detach()) == pytest.approx(-(1 + 1 - 1) / 3)
    loss.backward()
    assert torch.allclose(new.grad, -torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]]) / 3)


def test_a_batch_carries_its_samples_weights_and_counts_its_episodes():
    second = 7 + 10**12  # sample 1 of episode 7
    raw = _raw(
        [GOOD | {"sample_id": 7, "weight": 0.5}, GOOD | {"sample_id": second, "weight": 0.5}, GOOD | {"sample_id": 8}]
    )
    batch = parse_batch(raw, 1, VOCAB)
    assert batch.sample_weights.tolist() == [0.5, 0.5, 1.0] and batch.episodes == 2
    one = parse_batch(_raw([GOOD, GOOD | {"sample_id": 1}]), 1, VOCAB)
    assert one.sample_weights.tolist() == [1.0, 1.0] and b"sample_weight" not in _raw([GOOD])

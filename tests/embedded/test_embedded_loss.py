"""Sign and gradient sanity of the clipped importance-ratio policy-gradient loss."""

import pytest
import torch

from orchestrator.embedded.policy import build_policy, token_logprobs
from orchestrator.embedded.trainer import Trainer, parse_batch, pg_loss

import orjson

from conftest import make_samples, tiny_trainer_config


def _batch(samples, step=1):
    return parse_batch(orjson.dumps({"format": 1, "step": step, "samples": samples}), step)


def _sampled_logprob_sum(model, batch):
    with torch.no_grad():
        lp = token_logprobs(model, batch.ids, batch.temperature)
    return float((lp * batch.mask).sum())


@pytest.mark.parametrize("advantage, direction", [(1.0, +1), (-1.0, -1)])
def test_advantage_sign_moves_logprob_of_sampled_tokens(tmp_path, advantage, direction):
    cfg = tiny_trainer_config(lr=1e-2)
    trainer = Trainer(tmp_path, cfg, log=lambda s: None)
    trainer.model = build_policy(cfg.policy, seed=0)
    trainer.optimizer = trainer._new_optimizer(trainer.model)
    batch = _batch(make_samples(trainer.model, 1, advantage=advantage))
    before = _sampled_logprob_sum(trainer.model, batch)
    stats = trainer.train_on_batch(batch)
    after = _sampled_logprob_sum(trainer.model, batch)
    assert direction * (after - before) > 1e-3
    assert stats.tokens == int(batch.mask.sum()) and stats.samples == len(batch.ids)


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
    assert info["clipfrac"] == 0.0


def test_ratio_clipping_zeros_gradient_beyond_the_clip():
    eps = 0.2
    old = torch.zeros(1, 6)
    # log-ratios: inside, above 1+eps, below 1-eps (per token)
    lr = torch.tensor([[0.0, 0.05, 0.5, -0.5, 0.5, -0.5]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for adv, zero_cols, live_cols in [(1.0, [2], [1, 3]), (-1.0, [3], [1, 2])]:
        new = lr.clone().requires_grad_(True)
        loss, info = pg_loss(new, old, torch.tensor([adv]), mask, eps)
        loss.backward()
        g = new.grad[0]
        for c in zero_cols:  # pushed beyond the clip in the advantage's direction: no gradient
            assert g[c] == 0.0
        for c in live_cols:  # inside the clip, or on the pessimistic side: gradient flows
            assert g[c] != 0.0
        assert g[0] == 0.0  # masked token
        assert info["clipfrac"] == pytest.approx(4 / 5)

"""Shared helpers for the embedded policy/trainer tests (tiny models, 1 torch thread)."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch.set_num_threads(1)

from orchestrator.embedded.policy import PolicyConfig, sample_group  # noqa: E402
from orchestrator.embedded.trainer import TrainerConfig  # noqa: E402
from orchestrator.envs.reverse_text import ReverseTextEnv  # noqa: E402

TINY_POLICY = PolicyConfig(d_model=16, layers=1, heads=2, d_ff=16)


def tiny_trainer_config(**kw) -> TrainerConfig:
    base = dict(policy=TINY_POLICY, sft_steps=2, sft_batch_size=4, max_steps=3, batch_wait_timeout_s=20.0,
                poll_interval_s=0.01, max_new_tokens=12)
    base.update(kw)
    return TrainerConfig(**base)


def make_samples(model, step: int, *, groups: int = 2, n: int = 4, temperature: float = 1.0,
                 max_new_tokens: int = 12, advantage=None, seed: int = 0) -> list[dict]:
    """Batch-file samples sampled from ``model``; GRPO-like alternating advantages unless given."""
    env = ReverseTextEnv(seed=seed)
    out = []
    for g in range(groups):
        task = env.task(step * 100 + g)
        comps = sample_group(model, task.prompt, n, temperature=temperature,
                             max_new_tokens=max_new_tokens, seed=seed + step * 100 + g)
        for k, c in enumerate(comps):
            adv = advantage if advantage is not None else (0.5 if k % 2 == 0 else -0.5)
            out.append({"trace_id": g * n + k, "group_id": g, "env": env.name, "token_ids": c.token_ids,
                        "mask": c.mask, "logprobs": c.full_logprobs, "advantage": adv,
                        "policy_start": 0, "lag": step - 1, "temperature": temperature})
    return out


@pytest.fixture
def tiny_policy_config() -> PolicyConfig:
    return TINY_POLICY

"""`trainer.hf.loss`: the hf trainer's loss options (docs/hf.md "Loss"). Light: pydantic only, so
the run's config checks it before anything runs; the formulas are orchestrator/hf/loss.py's.

Every default is the loss the trainer always had: PPO clip of the token ratio to the sampler's
logprobs, no correction, the global token mean, no KL, one optimizer step per batch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from orchestrator.contracts import Section

Correction = Literal["none", "tis", "seq_tis", "icepop", "seq_mask", "decoupled"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]


class LossConfig(Section):
    """The policy-gradient loss of one batch and the optimizer steps taken on it."""

    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token; sequence (GSPO): the geometric mean of a sample's"
    )
    clip: Literal["ppo", "none"] = Field(
        "ppo", description="ppo: the ratio clipped to [1-clip_low, 1+clip_high]; none: no clip (REINFORCE)"
    )
    clip_low: float | None = Field(None, gt=0, lt=1, description="lower clip epsilon (None: clip_eps)")
    clip_high: float | None = Field(None, gt=0, description="upper clip epsilon, 'clip higher' (None: clip_eps)")
    correction: Correction = Field(
        "none",
        description="sampler/trainer mismatch correction: none (bypass), tis, seq_tis, icepop, seq_mask, decoupled",
    )
    truncate_at: float = Field(2.0, gt=1, description="C of tis, seq_tis and decoupled: weights above are cut to C")
    mask_low: float = Field(0.5, ge=0, description="icepop / seq_mask: ratios below are masked")
    mask_high: float = Field(2.0, gt=0, description="icepop / seq_mask: ratios above are masked")
    aggregation: Aggregation = Field(
        "token-mean",
        description="token-mean (global), seq-mean-token-mean, seq-mean-token-sum, constant (Dr. GRPO)",
    )
    normalizer: float = Field(0.0, ge=0, description="aggregation='constant': tokens per sample it divides by")
    kl_reference: Literal["none", "initial"] = Field(
        "none", description="initial: KL to the starting weights (LoRA: the base, adapter off) is measured"
    )
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator of the reference term")
    kl_coef: float = Field(0.0, ge=0, description="weight of the reference KL in the loss (needs kl_reference)")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass over a batch (its samples split)")
    epochs: int = Field(1, ge=1, description="passes over each batch")

    @model_validator(mode="after")
    def _consistent(self) -> LossConfig:
        if self.mask_low >= self.mask_high:
            raise ValueError(f"trainer.hf.loss.mask_low {self.mask_low} must be < mask_high {self.mask_high}")
        if self.kl_coef > 0 and self.kl_reference == "none":
            raise ValueError(
                "trainer.hf.loss.kl_coef > 0 needs a reference: set trainer.hf.loss.kl_reference='initial'"
            )
        if self.aggregation == "constant" and self.normalizer <= 0:
            raise ValueError("trainer.hf.loss.aggregation='constant' needs trainer.hf.loss.normalizer > 0")
        if self.aggregation != "constant" and self.normalizer > 0:
            raise ValueError("trainer.hf.loss.normalizer is used only with aggregation='constant'")
        return self

    @property
    def optimizer_steps(self) -> int:
        return self.mini_batches * self.epochs

    def clip_range(self, clip_eps: float) -> tuple[float, float]:
        """(low, high) epsilons of the PPO clip."""
        low = clip_eps if self.clip_low is None else self.clip_low
        return low, clip_eps if self.clip_high is None else self.clip_high

    def needs_old_policy(self) -> bool:
        """Whether a batch needs the trainer's logprobs before its first update (a forward pass):
        decoupled PPO's proximal policy, and the exact pre-update mismatch with several steps."""
        return self.correction == "decoupled" or self.optimizer_steps > 1

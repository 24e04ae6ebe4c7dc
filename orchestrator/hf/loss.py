"""The policy-gradient loss every trainer uses, and the per-token quantities it is made of.

`token_logprobs` recomputes, from a causal LM's logits, the logprob of each token under the
temperature-scaled distribution the sampler drew it from; `policy_loss` is the loss of a batch's
sampled tokens under the `trainer.hf.loss` options (docs/hf.md "Loss"); by default the clipped
importance-ratio (PPO form) loss against the sampler's logprobs, a global token mean.

Three policies take part: the sampler's (mu, the batch's logprobs), the trainer's before this
batch's first update (old, recomputed by a forward pass only when an option needs it), and the
one being trained (theta). Every function returns the batch's share of this micro-batch: sums
divided by the whole (mini-)batch's counts (`Counts`), so micro-batches and ranks add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orchestrator.hf.batch import Batch
from orchestrator.hf.loss_config import LossConfig

# Corrections that weight the ratio to the sampler itself (no forward pass of their own).
BYPASS_CORRECTIONS = frozenset({"tis", "seq_tis", "icepop", "seq_mask"})
# Statistics reduced by max across micro-batches and ranks; the others are sums.
MAX_STATS = frozenset({"ratio_max", "weight_max"})


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), both [B, T]: position t holds log p(ids[t] | ids[:t]) and the entropy
    of that distribution, under ``log_softmax(logits[t-1] / temperature)``; position 0 holds 0.
    `logits` [B, T, V] are the model's outputs on `ids` [B, T]; `temperature` is [B]."""
    scaled = logits[:, :-1].float() / temperature.to(torch.float32).view(-1, 1, 1)
    logp = torch.log_softmax(scaled, dim=-1)
    picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))


@dataclass(frozen=True)
class Counts:
    """The (mini-)batch's sampled tokens and samples with at least one, over every rank."""

    tokens: int
    samples: int

    @classmethod
    def of(cls, mask: torch.Tensor) -> Counts:
        return cls(int(mask.sum()), int(mask.any(-1).sum()))


def aggregation_weights(
    mask: torch.Tensor, config: LossConfig, counts: Counts, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-token weight of the aggregation (0 off the sampled tokens): the loss is
    sum(token loss * weight). token-mean: 1/N_tokens; seq-mean-token-mean: 1/(n_i N_samples);
    seq-mean-token-sum: 1/N_samples; constant (Dr. GRPO): 1/(L N_samples)."""
    mask_f = mask.to(dtype)
    samples = float(max(counts.samples, 1))
    if config.aggregation == "token-mean":
        return mask_f / float(max(counts.tokens, 1))
    if config.aggregation == "seq-mean-token-mean":
        return mask_f / (mask_f.sum(-1, keepdim=True).clamp(min=1.0) * samples)
    if config.aggregation == "seq-mean-token-sum":
        return mask_f / samples
    return mask_f / (config.normalizer * samples)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its sampled tokens, broadcast to the row ([B, T])."""
    mask_f = mask.to(values.dtype)
    mean = (values * mask_f).sum(-1, keepdim=True) / mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    return mean.expand_as(values)


def at_level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token log ratios as the ratio level has them: themselves, or (GSPO) the row's mean (the
    log of the geometric mean of its token ratios), with the gradient of that mean."""
    return log_ratio if level == "token" else sequence_mean(log_ratio, mask)


def bypass_weight(
    config: LossConfig, ratio: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, truncated, masked) per token of the bypass corrections, from rho = pi_theta / mu
    (`ratio`, at the ratio level, no gradient) and the token log ratios:

    tis: min(rho, C); seq_tis: min(prod_t rho_t, C) for every token of the row; icepop: rho, 0 where
    rho is outside [low, high]; seq_mask: rho, 0 on every token of a row whose geometric-mean ratio
    is outside [low, high]."""
    cut, low, high = config.truncate_at, config.mask_low, config.mask_high
    none = torch.zeros_like(mask)
    if config.correction == "tis":
        return ratio.clamp(max=cut), (ratio > cut) & mask, none
    if config.correction == "seq_tis":
        seq = torch.exp((token_log_ratio * mask).sum(-1, keepdim=True)).expand_as(ratio)
        return seq.clamp(max=cut), (seq > cut) & mask, none
    if config.correction == "icepop":
        outside = (ratio < low) | (ratio > high)
    else:  # seq_mask
        geo = torch.exp(sequence_mean(token_log_ratio, mask))
        outside = (geo < low) | (geo > high)
    return torch.where(outside, torch.zeros_like(ratio), ratio), none, outside & mask


def masked_log_ratio(logprobs: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(p / anchor) per token, 0 off the sampled tokens."""
    return torch.where(mask, logprobs - anchor, torch.zeros_like(logprobs))


def k3(log_r: torch.Tensor) -> torch.Tensor:
    """The k3 estimate, r - 1 - log r, per token of the log ratios `log_r` (>= 0)."""
    return torch.exp(log_r) - 1.0 - log_r


def reference_kl(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled near pi_theta: k1 = log
    pi_theta - log pi_ref; k3 = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1."""
    log_r = ref_logprobs - new_logprobs
    return -log_r if estimator == "k1" else k3(log_r)


def policy_loss(
    new_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    config: LossConfig,
    counts: Counts,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sample_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the (mini-)batch loss, and its statistics' sums (shares of
    token counts for the fractions; `MAX_STATS` are maxima).

    The ratio r is pi_theta / mu, or pi_theta / pi_old for decoupled PPO (`old_logprobs`), at the
    ratio level. Token loss: ppo: -min(r A, clip(r, 1-low, 1+high) A); none: -r A. Bypass
    corrections keep r's clip region and replace r's weight by w(r): -sg(w gate) A grad(log r);
    decoupled multiplies the token loss by min(pi_old / mu, C). With a reference, kl_coef times
    the aggregated KL estimate is added. Statistics: ``clipped`` (tokens whose r is outside the
    clip range), ``mismatch_k3`` (k3 of KL(mu || pi_theta) on this pass), ``weight`` /
    ``weight_max`` (the importance weight), ``truncated``, ``masked``, ``kept`` (tokens with a
    weight > 0), ``kl_ref``, ``ratio_max``. `sample_weights` ([B], the batch file's
    `sample_weight`) multiplies each row's token losses and KL terms before the aggregation.
    """
    mask_f = mask.to(new_logprobs.dtype)
    zeros = torch.zeros_like(new_logprobs)
    low, high = config.clip_range(clip_eps)
    decoupled = config.correction == "decoupled"
    if decoupled and old_logprobs is None:
        raise ValueError("decoupled PPO needs the old policy's logprobs")
    anchor = old_logprobs if decoupled and old_logprobs is not None else sampler_logprobs
    token_log_ratio = masked_log_ratio(new_logprobs, anchor, mask)
    log_ratio = at_level(token_log_ratio, mask, config.ratio_level)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype).view(-1, 1).expand_as(ratio)
    r = ratio.detach()
    r_log = token_log_ratio.detach()
    ppo = config.clip == "ppo"
    above, below = r - 1.0 > high, 1.0 - r > low
    outside_clip = (above | below) & mask
    truncated = masked = torch.zeros_like(mask)
    weight = r
    if config.correction in BYPASS_CORRECTIONS:
        weight, truncated, masked = bypass_weight(config, r, r_log, mask)
        # the PPO clip's region: no gradient where r is beyond it the way the advantage pushes
        beyond = (above & (adv > 0)) | (below & (adv < 0))
        gate = torch.where(beyond, zeros, weight) if ppo else weight
        token_loss = -gate * adv * torch.exp(log_ratio - log_ratio.detach())
    else:
        if ppo:
            token_loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - low, 1.0 + high) * adv)
        else:
            token_loss = -ratio * adv
        if decoupled and old_logprobs is not None:
            old_log_ratio = masked_log_ratio(old_logprobs, sampler_logprobs, mask)
            behaviour = torch.exp(at_level(old_log_ratio, mask, config.ratio_level))
            weight = behaviour.clamp(max=config.truncate_at)
            truncated = (behaviour > config.truncate_at) & mask
            token_loss = token_loss * weight
    row_weight = None if sample_weights is None else sample_weights.to(token_loss.dtype).view(-1, 1)
    if row_weight is not None:
        token_loss = token_loss * row_weight
    if config.aggregation == "token-mean":  # as the loss always had it: one division
        n = torch.tensor(float(counts.tokens)).clamp(min=1.0)
        loss = (token_loss * mask_f).sum() / n
    else:
        loss = (token_loss * aggregation_weights(mask, config, counts, token_loss.dtype)).sum()
    kl: torch.Tensor | None = None
    if ref_logprobs is not None:
        kl = reference_kl(new_logprobs, ref_logprobs, config.kl_estimator)
        if config.kl_coef > 0:
            weighted_kl = kl if row_weight is None else kl * row_weight
            loss = loss + config.kl_coef * (weighted_kl * aggregation_weights(mask, config, counts, kl.dtype)).sum()
    with torch.no_grad():
        # the anchor is the sampler's unless decoupled: then the ratio already is pi_theta / mu
        sampler_log_ratio = masked_log_ratio(new_logprobs, sampler_logprobs, mask) if decoupled else r_log
        zero = torch.zeros((), dtype=torch.float64, device=new_logprobs.device)
        # maxima of values >= 0 with the other tokens at 0 (an empty micro-batch's is 0), and one
        # transfer of every statistic to the host
        values = {
            "clipped": outside_clip.sum() if ppo else zero,
            "mismatch_k3": (k3(sampler_log_ratio) * mask_f).sum(),
            "weight": (weight * mask_f).sum(),
            "weight_max": torch.where(mask, weight, 0.0).amax(),
            "truncated": truncated.sum(),
            "masked": masked.sum(),
            "kept": ((weight > 0) & mask).sum(),
            "kl_ref": zero if kl is None else (kl.detach() * mask_f).sum(),
            "ratio_max": torch.where(mask, r, 0.0).amax(),
        }
        stats = dict(zip(values, torch.stack([v.to(torch.float64) for v in values.values()]).tolist(), strict=True))
    return loss, stats


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two parts' stats as one: sums, and maxima for `MAX_STATS`."""
    if not a:
        return dict(b)
    return {key: max(a[key], value) if key in MAX_STATS else a[key] + value for key, value in b.items()}


def mini_batches(batch: Batch, count: int) -> list[Batch]:
    """The batch's samples in `count` consecutive, near-equal mini-batches (one step each)."""
    if count == 1:
        return [batch]
    return [batch.rows(index) for index in torch.tensor_split(torch.arange(batch.ids.shape[0]), count) if len(index)]


def batch_metrics(
    batch: Batch,
    steps: list[dict[str, float]],
    first_pass: dict[str, float],
    old_pass: dict[str, float],
    total_tokens: int,
    kl_on: bool,
) -> dict[str, float]:
    """A batch's metrics (weights/step_N/metrics.json) from its optimizer steps' stats: per token
    of the batch from the first epoch (each token once), per step averaged, `clipfrac_max` the
    largest of the mini-batches'. `mismatch_kl` is before any update: from the old-policy pass
    when there was one, else from the only step's forward passes."""
    n = float(max(total_tokens, 1))
    taken = [step for step in steps if not step["skipped"]]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    clipfracs = [step["clipped"] / step["tokens"] for step in steps]
    passed = first_pass or dict.fromkeys(("entropy", "mismatch_k3", "weight", "truncated", "masked", "kl_ref"), 0.0)
    adv = batch.advantages
    rewards = {"reward_mean": sum(batch.rewards) / len(batch.rewards)} if batch.rewards else {}
    kl = {"kl_ref": passed["kl_ref"] / n} if kl_on else {}
    return {
        "step": batch.step,
        "loss": mean([step["loss"] for step in steps]),
        "grad_norm": mean([step["grad_norm"] for step in taken]),
        "entropy": passed["entropy"] / n,
        "mismatch_kl": old_pass.get("mismatch_k3", passed["mismatch_k3"]) / n,
        "clipfrac": mean(clipfracs),
        "clipfrac_max": max(clipfracs, default=0.0),
        "ratio_max": max((step["ratio_max"] for step in steps), default=1.0),
        "is_weight_mean": passed["weight"] / n,
        "is_weight_max": first_pass.get("weight_max", 0.0),
        "truncated_frac": passed["truncated"] / n,
        "masked_frac": passed["masked"] / n,
        **kl,
        "optimizer_steps": len(taken),
        "skipped_steps": len(steps) - len(taken),
        "samples": int(batch.ids.shape[0]),
        "samples_per_episode": int(batch.ids.shape[0]) / batch.episodes if batch.episodes else 0.0,
        "tokens": total_tokens,
        "adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0,
        **rewards,  # absent, not null, for a batch without rewards (e.g. an empty one)
    }

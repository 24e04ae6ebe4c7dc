"""The policy-gradient loss every trainer uses, and the per-token quantities it is made of.

`token_logprobs` recomputes, from a causal LM's logits, the logprob of each token under the
temperature-scaled distribution the sampler drew it from; `pg_loss` is the clipped
importance-ratio (PPO form) loss over the sampled tokens of a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def pg_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    n_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped importance-ratio policy-gradient loss (PPO form), mean over sampled tokens.

    ratio = exp(new - old) per token; per-token advantage = the sample's advantage;
    loss_t = -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A). Tokens whose ratio is beyond the clip
    in the direction the advantage pushes get zero gradient. `n_tokens` is the mean's divisor
    (default: the sampled tokens of these rows; a rank's shard passes the whole batch's count so
    that the ranks' summed losses are the batch's).

    Also returns ``clipfrac``, ``ratio_max`` and ``mismatch_kl``: the k3 estimate of
    KL(sampler || this model) on the sampled tokens. At the first (here: only) optimizer step
    of a batch sampled by the weights being trained, it measures sampler/trainer numerical
    mismatch; otherwise it also includes the policy's lag.
    """
    mask_f = mask.to(new_logprobs.dtype)
    n = torch.tensor(float(n_tokens)) if n_tokens is not None else mask_f.sum()
    n = n.clamp(min=1.0)
    log_ratio = torch.where(mask, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype).view(-1, 1).expand_as(ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    loss = -(torch.minimum(unclipped, clipped) * mask_f).sum() / n
    with torch.no_grad():
        clipfrac = float((((ratio - 1.0).abs() > clip_eps) & mask).sum()) / float(n)
        mismatch_kl = float((((ratio - 1.0) - log_ratio) * mask_f).sum()) / float(n)  # k3
        ratio_max = float(ratio[mask].max()) if bool(mask.any()) else 1.0
    return loss, {"clipfrac": clipfrac, "mismatch_kl": mismatch_kl, "ratio_max": ratio_max}

"""The batch schema every trainer reads: `batches/step_N.json` (format 1) validated and tensorized.

One parser for every trainer (the HF trainer, full or LoRA, one process or N ranks): a batch that
one trainer accepts, every trainer accepts, and each rejection names the sample and the field.
The file's layout is documented in :mod:`orchestrator.rundir`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrator.rundir import BatchFileError, batch_samples, sample_tag


class BatchError(BatchFileError):
    """A batch file that breaks the schema; the message names the file, the sample and the field."""


@dataclass
class Batch:
    step: int
    ids: torch.Tensor  # [B, T] long, right-padded with token 0
    attention: torch.Tensor  # [B, T] long: 1 on the sequence's tokens, 0 on the padding
    mask: torch.Tensor  # [B, T] bool: the sampled tokens (the loss's tokens)
    old_logprobs: torch.Tensor  # [B, T] float: the sampler's logprob per sampled token
    advantages: torch.Tensor  # [B] float
    temperature: torch.Tensor  # [B] float
    rewards: list[float] | None  # optional field "reward" of every sample, for the step line only

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    def rows(self, index: torch.Tensor) -> Batch:
        """The samples at `index` (a rank's shard, a micro-batch); none: one zero-weight row (no
        sampled token), so that a rank with nothing to train still joins its ranks' collectives."""
        if len(index) == 0:
            empty = self.rows(index.new_zeros(1))
            empty.mask = torch.zeros_like(empty.mask)
            return empty
        return Batch(
            self.step,
            self.ids[index],
            self.attention[index],
            self.mask[index],
            self.old_logprobs[index],
            self.advantages[index],
            self.temperature[index],
            None,
        )


def parse_batch(raw: bytes, expected_step: int, vocab_size: int, where: str = "batch") -> Batch:
    """Validate and tensorize a format-1 batch; raises :class:`BatchError` naming the problem."""
    try:
        samples = batch_samples(raw, expected_step, where)  # the schema every trainer shares
    except BatchFileError as err:
        raise BatchError(str(err)) from err
    for i, sample in enumerate(samples):
        check_sample(sample, vocab_size, sample_tag(where, i, sample))
    return tensorize(expected_step, samples)


def check_sample(sample: dict, vocab_size: int, tag: str) -> None:
    """A sample's values against the model (the schema checked it carries `TRAINED_FIELDS`)."""
    ids, mask, lp = sample["token_ids"], sample["mask"], sample["logprobs"]
    if not (isinstance(ids, list) and isinstance(mask, list) and isinstance(lp, list)):
        raise BatchError(f"{tag}: token_ids, mask and logprobs must be lists")
    if not (len(ids) == len(mask) == len(lp)) or len(ids) < 2:
        raise BatchError(f"{tag}: token_ids/mask/logprobs lengths differ or < 2 ({len(ids)}, {len(mask)}, {len(lp)})")
    if any(type(t) is not int or not 0 <= t < vocab_size for t in ids):
        raise BatchError(f"{tag}: token id outside the model's vocabulary [0, {vocab_size})")
    if any(m not in (0, 1) for m in mask) or mask[0] != 0:
        raise BatchError(f"{tag}: mask must be 0/1 with mask[0] == 0 (the first token has no logprob)")
    if any(not isinstance(x, (int, float)) for x in lp) or any(m and not x <= 0.0 for m, x in zip(mask, lp)):
        raise BatchError(f"{tag}: logprobs must be numbers <= 0 on sampled tokens")
    adv, temp = sample["advantage"], sample["temperature"]
    if not isinstance(adv, (int, float)) or adv != adv or abs(adv) == float("inf"):
        raise BatchError(f"{tag}: advantage must be a finite number, got {adv!r}")
    if not isinstance(temp, (int, float)) or not temp > 0:
        raise BatchError(f"{tag}: temperature must be > 0, got {temp!r}")


def tensorize(step: int, samples: list[dict]) -> Batch:
    """Checked samples as right-padded tensors."""
    if not samples:
        empty = torch.zeros(0, 2)
        return Batch(step, empty.long(), empty.long(), empty.bool(), empty, torch.zeros(0), torch.ones(0), None)
    width = max(len(s["token_ids"]) for s in samples)

    def padded(key: str, fill, dtype) -> torch.Tensor:
        return torch.tensor([s[key] + [fill] * (width - len(s[key])) for s in samples], dtype=dtype)

    lengths = torch.tensor([len(s["token_ids"]) for s in samples])
    rewards = [s["reward"] for s in samples if isinstance(s.get("reward"), (int, float))]
    return Batch(
        step=step,
        ids=padded("token_ids", 0, torch.long),
        attention=(torch.arange(width).view(1, -1) < lengths.view(-1, 1)).long(),
        mask=padded("mask", 0, torch.bool),
        old_logprobs=padded("logprobs", 0.0, torch.float32),
        advantages=torch.tensor([float(s["advantage"]) for s in samples]),
        temperature=torch.tensor([float(s["temperature"]) for s in samples]),
        rewards=[float(r) for r in rewards] if len(rewards) == len(samples) else None,
    )

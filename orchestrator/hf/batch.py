"""The batch every trainer reads: `batches/step_N.safetensors` (orchestrator.core.batch) validated
and tensorized.

One parser for every trainer (the HF trainer, full or LoRA, one process or N ranks): a batch that
one trainer accepts, every trainer accepts, and each rejection names the sample and the field.
The file's layout is documented in :mod:`orchestrator.rundir`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orchestrator.core.batch import BatchArrays
from orchestrator.rundir import BatchFileError, read_batch_file, sample_tag


class BatchError(BatchFileError):
    """A batch file that breaks the schema; the message names the file, the sample and the field."""


@dataclass
class Batch:
    step: int
    ids: torch.Tensor  # [B, T] long, right-padded with token 0
    attention: torch.Tensor  # [B, T] long: 1 on the sequence's tokens, 0 on the padding
    mask: torch.Tensor  # [B, T] bool: the sampled tokens (the loss's tokens)
    sampler_logprobs: torch.Tensor  # [B, T] float: the sampler's logprob per sampled token
    advantages: torch.Tensor  # [B] float
    temperature: torch.Tensor  # [B] float
    rewards: list[float] | None  # optional field "reward" of every sample, for the step line only
    # Each sample's loss weight (docs/rules.md, "Samples": 1/N for an episode's N samples, or 1),
    # and the episodes the batch's samples come from.
    sample_weights: torch.Tensor | None = None  # [B] float; None: 1 each
    episodes: int = 0

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
            self.sampler_logprobs[index],
            self.advantages[index],
            self.temperature[index],
            None,
            None if self.sample_weights is None else self.sample_weights[index],
        )


def parse_batch(raw: bytes, expected_step: int, vocab_size: int, where: str = "batch") -> Batch:
    """Validate and tensorize a batch file; raises :class:`BatchError` naming the problem."""
    try:
        batch = read_batch_file(raw, expected_step, where)  # the layout every trainer shares
    except BatchFileError as err:
        raise BatchError(str(err)) from err
    check_samples(batch, vocab_size, where)
    return tensorize(batch)


def check_samples(batch: BatchArrays, vocab_size: int, where: str) -> None:
    """The samples' values against the model, over the flat arrays at once; the first bad sample
    is named."""
    starts = batch.offsets[:-1]
    token_sample = np.repeat(np.arange(len(batch)), np.diff(batch.offsets))  # each token's sample

    def first(bad_tokens: np.ndarray | None = None, bad_samples: np.ndarray | None = None) -> int | None:
        found = []
        if bad_tokens is not None and bad_tokens.any():
            found.append(int(token_sample[np.argmax(bad_tokens)]))
        if bad_samples is not None and bad_samples.any():
            found.append(int(np.argmax(bad_samples)))
        return min(found, default=None)

    ids, mask, lp = batch.token_ids, batch.mask, batch.logprobs
    checks = [
        (first(bad_samples=np.diff(batch.offsets) < 2), "fewer than 2 tokens"),
        (first((ids < 0) | (ids >= vocab_size)), f"token id outside the model's vocabulary [0, {vocab_size})"),
        (
            first(mask > 1, mask[np.minimum(starts, max(len(mask) - 1, 0))] != 0 if len(mask) else None),
            "mask must be 0/1 with mask[0] == 0 (the first token has no logprob)",
        ),
        (first((mask == 1) & ~(lp <= 0.0)), "logprobs must be numbers <= 0 on sampled tokens"),
        (first(bad_samples=~np.isfinite(batch.advantage)), "advantage must be a finite number"),
        (first(bad_samples=~(batch.temperature > 0)), "temperature must be > 0"),
    ]
    failed = [(index, message) for index, message in checks if index is not None]
    if failed:
        index, message = min(failed, key=lambda f: f[0])
        raise BatchError(f"{sample_tag(where, batch, index)}: {message}")


def tensorize(batch: BatchArrays) -> Batch:
    """Checked samples as right-padded tensors (the padded rows are the only copy made)."""
    n = len(batch)
    if not n:
        empty = torch.zeros(0, 2)
        return Batch(batch.step, empty.long(), empty.long(), empty.bool(), empty, torch.zeros(0), torch.ones(0), None)
    lengths = np.diff(batch.offsets)
    width = int(lengths.max())
    ids = np.zeros((n, width), np.int64)
    mask = np.zeros((n, width), np.bool_)
    sampler = np.zeros((n, width), np.float32)
    for i in range(n):
        span, k = batch.tokens(i), int(lengths[i])
        ids[i, :k] = batch.token_ids[span]
        mask[i, :k] = batch.mask[span]
        sampler[i, :k] = batch.logprobs[span]
    return Batch(
        step=batch.step,
        ids=torch.from_numpy(ids),
        attention=(torch.arange(width).view(1, -1) < torch.from_numpy(lengths).view(-1, 1)).long(),
        mask=torch.from_numpy(mask),
        sampler_logprobs=torch.from_numpy(sampler),
        advantages=torch.tensor(batch.advantage.tolist(), dtype=torch.float32),
        temperature=torch.tensor(batch.temperature.tolist(), dtype=torch.float32),
        rewards=batch.reward.tolist() if batch.reward is not None else None,
        sample_weights=torch.tensor(batch.sample_weight.tolist(), dtype=torch.float32),
        episodes=len(np.unique(batch.episode_id)),
    )

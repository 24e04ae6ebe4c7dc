"""The wire format of a weight push: named tensors packed into byte buckets, cut the same way on
both sides from the metadata alone (name, dtype, shape), so the receiver sizes each receive
buffer before any byte arrives and the two sides cannot disagree on where a bucket ends.

The rule is vLLM's packed broadcast's (`packed_tensor`): tensors are added to a bucket in order
and the bucket closes once it holds *more* than ``bucket_bytes``; a tensor is never split. orch
refuses a tensor larger than a bucket (before the run, and in the sender), so that a bucket
holds at most twice the size set. Any dtype travels as its bytes: bf16 and fp32 alike."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """One tensor as the receiver knows it before the bytes come: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def wire(self) -> tuple[str, str, list[int]]:
        """As vLLM's `/update_weights` carries it: name, dtype name ("bfloat16"), shape."""
        return self.name, str(self.dtype).removeprefix("torch."), list(self.shape)

    @classmethod
    def from_wire(cls, name: str, dtype_name: str, shape: Sequence[int]) -> ParamSpec:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype_name!r}")
        return cls(name, dtype, tuple(int(d) for d in shape))


def plan_buckets(specs: Sequence[ParamSpec], bucket_bytes: int) -> list[list[int]]:
    """The indices of ``specs`` in each bucket, in order: the same on sender and receiver."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        current.append(i)
        size += spec.nbytes
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated into one contiguous uint8 tensor (a copy: the sender's
    tensors stay as they are)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: torch.Tensor, specs: Sequence[ParamSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (uint8) as the tensors of ``specs``. They alias it: a receiver that
    reuses the buffer for the next bucket must copy them first (vLLM's layerwise reload keeps
    the tensors it is given until a whole layer is in, so each bucket gets a fresh buffer)."""
    offset = 0
    for spec in specs:
        n = spec.nbytes
        part = buffer[offset : offset + n]
        if offset % spec.dtype.itemsize:  # a view as a wider dtype must start at a multiple of its size
            part = part.clone()
        yield spec.name, part.view(spec.dtype).view(spec.shape)
        offset += n
    if offset != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes holds {offset} bytes of tensors")

"""The batch file the trainer reads: binary, in canonical bytes, so a re-materialized batch hashes
the same.

Format 4 is a safetensors file (any safetensors reader opens it): an 8-byte little-endian header
length, a JSON header (sorted keys, padded with spaces to a multiple of 8 bytes), then the
tensors' bytes, contiguous, little-endian, the 8-byte ones first, then the 4-byte, then the
1-byte ones (each group by name), so every tensor is aligned for a zero-copy view:

    advantage     F64 [n]      group_id  I64 [n]     lag  I64 [n]     offsets  I64 [n + 1]
    policy_start  I64 [n]      reward    F64 [n]     (only when every sample has one)
    sample_id     I64 [n]      temperature F64 [n]
    logprobs      F32 [T]      token_ids I32 [T]     version I32 [T]    mask U8 [T]

Sample i's tokens are `offsets[i]:offsets[i+1]` of the flat arrays (T tokens in all); `mask` is 1
on sampled tokens, `logprobs` the sampler's (0.0 where mask is 0), `version` the policy version
that sampled each token (-1 where mask is 0; a trace whose backend could tell only the bounds of
its versions has its oldest, policy_start, on every token: docs/rules.md, "A token's version");
`lag` the sample's true off-policy distance (step-1) - policy_start, by its oldest token, queue
time included. `sample_id` is the sample's id (its episode's id for an episode's only or first
sample: docs/rules.md, "Samples"); `sample_weight F64 [n]`, each sample's loss weight, is
there only when a weight is not 1 (a file without it weighs every sample 1). `__metadata__`
holds `format` ("4"), `step` and `envs` (a JSON list of the samples' env names).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

from orchestrator.core.events import SAMPLE_ID_STRIDE

BATCH_FORMAT = 4  # what each format changed: docs/log-format.md, "Version history"
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "F32": np.dtype("<f4"),
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),
}
_PER_SAMPLE = {
    "advantage": "F64",
    "group_id": "I64",
    "lag": "I64",
    "policy_start": "I64",
    "temperature": "F64",
    "sample_id": "I64",
}
_PER_TOKEN = {"logprobs": "F32", "token_ids": "I32", "version": "I32", "mask": "U8"}
_MAX_HEADER = 1 << 24


class BatchSample(NamedTuple):
    """One sample as a batch file holds it; the arrays are anything numpy reads as a flat array
    (a trace's packed arrays are read without a copy)."""

    sample_id: int
    group_id: int
    env: str
    token_ids: Any
    mask: Any
    logprobs: Any
    advantage: float
    policy_start: int
    lag: int
    temperature: float
    reward: float | None = None
    # Per token: the version that sampled it, -1 where mask is 0 (`token_versions`); None:
    # policy_start on every sampled token.
    version: Any = None
    weight: float = 1.0  # its loss weight (docs/rules.md, "Samples")


def token_versions(mask: Any, runs: Sequence[tuple[int, int]], policy_start: int) -> np.ndarray:
    """Each token's version (int32): -1 where `mask` is 0, the sampled tokens' from their runs
    (`EpisodeCompleted.token_versions`), or all policy_start where there are none."""
    flags = np.frombuffer(mask, dtype=np.uint8) if type(mask) is bytes else np.asarray(mask, dtype=np.uint8)
    versions = np.full(len(flags), -1, dtype=np.int32)
    sampled = flags.astype(bool)
    if runs:
        versions[sampled] = np.repeat([v for v, _ in runs], [n for _, n in runs])
    else:
        versions[sampled] = policy_start
    return versions


def sample_of(trace, env: str, advantage: float, lag: int, weight: float) -> BatchSample:
    """The sample a trace (`state.Trace`) makes."""
    return BatchSample(
        trace.trace_id,
        trace.group_id,
        env,
        trace.token_ids,
        trace.mask,
        trace.logprobs,
        advantage,
        trace.policy_start,
        lag,
        trace.temperature,
        version=token_versions(trace.mask, trace.token_versions, trace.policy_start) if trace.token_versions else None,
        weight=weight,
    )


def _flat(samples: Sequence[BatchSample], field: str, dtype: np.dtype) -> np.ndarray:
    parts = [
        np.frombuffer(x, dtype=np.uint8) if type(x) is bytes else np.asarray(x)
        for x in (_per_token(s, field) for s in samples)
    ]
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _per_token(sample: BatchSample, field: str) -> Any:
    if field == "version" and sample.version is None:
        return token_versions(sample.mask, (), sample.policy_start)
    return getattr(sample, field)


def encode_batch(step: int, samples: Sequence[BatchSample]) -> bytes:
    """The canonical bytes of batch `step`."""
    lengths = [len(s.token_ids) for s in samples]
    offsets = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tensors: dict[str, tuple[str, np.ndarray]] = {"offsets": ("I64", offsets)}
    for name, code in _PER_SAMPLE.items():
        tensors[name] = (code, np.array([getattr(s, name) for s in samples], dtype=_DTYPES[code]))
    rewards = [s.reward for s in samples]
    if samples and all(r is not None for r in rewards):
        tensors["reward"] = ("F64", np.array(rewards, dtype=_DTYPES["F64"]))
    if any(s.weight != 1.0 for s in samples):  # absent: every sample weighs 1 (a one-sample run's batches)
        tensors["sample_weight"] = ("F64", np.array([s.weight for s in samples], dtype=_DTYPES["F64"]))
    for name, code in _PER_TOKEN.items():
        tensors[name] = (code, _flat(samples, name, _DTYPES[code]))
    order = sorted(tensors, key=lambda name: (-_DTYPES[tensors[name][0]].itemsize, name))
    header: dict[str, Any] = {
        "__metadata__": {
            "envs": orjson.dumps([s.env for s in samples]).decode(),
            "format": str(BATCH_FORMAT),
            "step": str(step),
        }
    }
    start = 0
    for name in order:
        code, values = tensors[name]
        end = start + values.nbytes
        header[name] = {"data_offsets": [start, end], "dtype": code, "shape": list(values.shape)}
        start = end
    head = orjson.dumps(header, option=orjson.OPT_SORT_KEYS)
    head += b" " * (-len(head) % 8)
    return b"".join([len(head).to_bytes(8, "little"), head, *(tensors[name][1].tobytes() for name in order)])


def batch_sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True)
class BatchArrays:
    """A batch file read without a copy: every array is a view of the file's bytes."""

    step: int
    envs: list[str]
    offsets: np.ndarray  # int64 [n + 1]
    sample_id: np.ndarray  # int64 [n]
    group_id: np.ndarray
    policy_start: np.ndarray
    lag: np.ndarray
    advantage: np.ndarray  # float64 [n]
    temperature: np.ndarray
    reward: np.ndarray | None  # float64 [n], when every sample has one
    sample_weight: np.ndarray  # float64 [n]: each sample's loss weight (ones where the file has none)
    token_ids: np.ndarray  # int32 [T]
    version: np.ndarray  # int32 [T]: each token's policy version, -1 where mask is 0
    mask: np.ndarray  # uint8 [T]
    logprobs: np.ndarray  # float32 [T]

    def __len__(self) -> int:
        return len(self.sample_id)

    @property
    def episode_id(self) -> np.ndarray:
        """Each sample's episode (int64 [n]): a sample id is its episode's id plus its index
        times `events.SAMPLE_ID_STRIDE`."""
        return self.sample_id % SAMPLE_ID_STRIDE

    def tokens(self, i: int) -> slice:
        """Sample i's tokens in the flat arrays."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def decode_batch(payload: bytes | memoryview) -> BatchArrays:
    """The arrays of a batch file's bytes, as views; ValueError (one line) if it is not a batch
    file of format 4 (header, dtypes, shapes, offsets)."""
    view = memoryview(payload)
    if len(view) < 8:
        raise ValueError("shorter than a safetensors header")
    size = int.from_bytes(view[:8], "little")
    if not 0 < size <= min(_MAX_HEADER, len(view) - 8):
        raise ValueError(f"not a safetensors file (header length {size})")
    try:
        header = orjson.loads(bytes(view[8 : 8 + size]))
        meta = header.pop("__metadata__")
        fmt, step, envs = meta["format"], int(meta["step"]), orjson.loads(meta["envs"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"not a batch file: its header does not parse ({err})") from None
    if fmt != str(BATCH_FORMAT):
        raise ValueError(f"format must be {BATCH_FORMAT}, got {fmt!r}")
    data = view[8 + size :]
    arrays = {
        name: _tensor(header, name, code, data)
        for name, code in {**_PER_SAMPLE, **_PER_TOKEN, "offsets": "I64"}.items()
    }
    reward = _tensor(header, "reward", "F64", data) if "reward" in header else None
    n, total = len(arrays["sample_id"]), len(arrays["token_ids"])
    if "sample_weight" in header:
        weight = _tensor(header, "sample_weight", "F64", data)
        if len(weight) != n or not np.all(np.isfinite(weight)) or np.any(weight < 0):
            raise ValueError("its sample_weight is not one finite weight >= 0 per sample")
    else:
        weight = np.ones(n, dtype=_DTYPES["F64"])
    offsets = arrays["offsets"]
    if any(len(arrays[name]) != n for name in _PER_SAMPLE) or (reward is not None and len(reward) != n):
        raise ValueError("its per-sample arrays differ in length")
    if any(len(arrays[name]) != total for name in _PER_TOKEN) or len(offsets) != n + 1 or len(envs) != n:
        raise ValueError("its token arrays, offsets or env names do not match its samples")
    if offsets[0] != 0 or offsets[-1] != total or (n and np.any(np.diff(offsets) < 0)):
        raise ValueError("its offsets do not split its tokens")
    return BatchArrays(step=step, envs=envs, reward=reward, sample_weight=weight, **arrays)


def _tensor(header: dict, name: str, code: str, data: memoryview) -> np.ndarray:
    info = header.get(name)
    if not isinstance(info, dict) or info.get("dtype") != code:
        raise ValueError(f"its {name!r} tensor is missing or not {code}")
    try:
        (length,), (start, end) = info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"its {name!r} tensor has a bad shape or offsets") from None
    dtype = _DTYPES[code]
    if not (0 <= start <= end <= len(data)) or end - start != length * dtype.itemsize:
        raise ValueError(f"its {name!r} tensor lies outside the file")
    return np.frombuffer(data[start:end], dtype=dtype)

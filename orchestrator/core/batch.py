"""The batch file the trainer reads: canonical bytes, so a re-materialized batch hashes the same.

Format 1: orjson (sorted keys) of
  {"format": 1, "step": N, "samples": [{"trace_id", "group_id", "env", "token_ids", "mask",
   "logprobs", "advantage", "policy_start", "lag", "temperature"}, ...]}
`mask` is 1 on sampled tokens; `logprobs` are the sampler's (0.0 where mask is 0); `lag` is the
sample's true off-policy distance (step-1) - policy_start, queue time included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import orjson

from orchestrator.core.state import Trace

BATCH_FORMAT = 1


# A batch file's keys are sorted: its dicts are built with their keys in that order, so orjson
# writes them as built, a third cheaper than sorting them (a test checks the bytes).
def sample_record(trace: Trace, env: str, advantage: float, lag: int) -> dict[str, Any]:
    return {
        "advantage": advantage,
        "env": env,
        "group_id": trace.group_id,
        "lag": lag,
        "logprobs": trace.logprobs.tolist(),
        "mask": list(trace.mask),
        "policy_start": trace.policy_start,
        "temperature": trace.temperature,
        "token_ids": trace.token_ids.tolist(),
        "trace_id": trace.episode_id,
    }


def encode_batch(step: int, samples: Iterable[dict[str, Any]]) -> bytes:
    return orjson.dumps({"format": BATCH_FORMAT, "samples": list(samples), "step": step})


def batch_sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()

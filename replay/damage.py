"""Telling a damaged log from non-deterministic code, for `orch replay RUN --check`, in a log
written before row checksums (format 2; a later log's rows carry a checksum that each row
`orch replay --check`, `--diff` and `--reexecute` re-read is checked against).

Such a log's payloads have no checksum (a side file's has, and a read refuses it): bytes changed
inside one decode as other token values, and the batch the check re-derives from them hashes
differently from the `batch_shipped` recorded. That divergence is the log's damage, not the code's,
when the batch file the run wrote is still on disk with the recorded sha256: each shipped trace's
payload is then compared with what that file holds of it, and the first that differs names the
damaged row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from eventlog import EventLog
from orchestrator.core.batch import decode_batch
from orchestrator.core.events import decode_event, episode_of
from orchestrator.core.samples import split_episode
from orchestrator.rundir import batch_path


def payload_damage(log: EventLog, shipped_seq: int, shipped: dict[str, Any]) -> str | None:
    """One line naming the damaged payload behind the recorded `batch_shipped` at `shipped_seq`
    (its data `shipped`), or None if the damage cannot be shown (no intact batch file to compare
    with, or every shipped trace's payload matches it)."""
    step, sha256 = shipped.get("step"), shipped.get("sha256")
    if not isinstance(step, int) or not isinstance(sha256, str):
        return None
    path = batch_path(Path(log.path).parent, step)  # the run dir the log is in
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if hashlib.sha256(raw).hexdigest() != sha256:
        return None
    try:
        batch = decode_batch(raw)
    except ValueError:
        return None
    index = {int(sample_id): i for i, sample_id in enumerate(batch.sample_id)}
    shipped_episodes = {episode_of(sample_id) for sample_id in index}
    for seq, _ts, _kind, data, payload in log.read_rows(stop=shipped_seq, kinds=("episode_completed",)):
        episode_id = _episode_fields(data).get("episode_id", -1)
        if episode_id not in shipped_episodes:
            continue
        where = f"seq {seq} (the episode_completed of episode {episode_id})"
        try:
            episode = decode_event("episode_completed", data, payload)
            samples = [s for s in split_episode(episode) if s.trace_id in index and s.tokens is not None]  # type: ignore[arg-type]
            arrays = [(index[s.trace_id], s.tokens.arrays()) for s in samples]  # type: ignore[union-attr]
        except ValueError as err:  # PayloadError, or a row that does not decode
            return f"{where}: its token payload does not decode ({err})"
        for i, (token_ids, mask, logprobs) in arrays:
            start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
            same = (
                np.array_equal(np.frombuffer(token_ids, np.int32), batch.token_ids[start:end])
                and np.frombuffer(mask, np.uint8).tobytes() == batch.mask[start:end].tobytes()
                and np.frombuffer(logprobs, np.float32).tobytes() == batch.logprobs[start:end].tobytes()
            )
            if not same:
                return (
                    f"{where}: its token payload differs from what {path} (sha256 {sha256[:12]}, as recorded at "
                    f"seq {shipped_seq}) shipped of it: the log is damaged, not the code non-deterministic"
                )
    return None


def _episode_fields(data: bytes) -> dict[str, Any]:
    try:
        fields = orjson.loads(data)
    except orjson.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}

"""Writing an in-memory event stream (e.g. a SimWorld's `log`) into a real orch event log.

Tests and benchmarks use it to build logs without running the asyncio shell.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from eventlog import EventLog
from orchestrator.core import events as ev
from orchestrator.orch_log import LOG_MAGIC_META


def write_events(
    path: str | os.PathLike,
    events: Iterable,
    meta: dict[str, str] | None = None,
    durability: str = "normal",
    commit_every: int = 8192,
) -> int:
    """Create an orch log at `path` holding `events` (event models) in order; return the last seq."""
    full_meta = {**LOG_MAGIC_META, **(meta or {})}
    with EventLog.create(path, meta=full_meta, durability=durability) as log:
        append = log.append_json
        for event in events:
            append(*ev.encode_event(event))
            if log.pending >= commit_every:
                log.commit()
        return log.commit() if log.pending else log.last_seq

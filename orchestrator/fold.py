"""Fold a log into the orchestrator state, from the newest usable snapshot when there is one.

On the orchestrator side, beside the core: a resume (orchestrator.shell.runner) and every replay
command fold through it, and neither package imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

from eventlog import EventLog
from orchestrator.core.evolve import FoldError, fold_rows
from orchestrator.core.state import REDUCER_VERSION, State, state_from_bytes
from orchestrator.gc_tuning import paused_gc


@dataclass(frozen=True)
class Folded:
    state: State | None  # None for a log without events (a run stopped before its first commit)
    seq: int  # last event folded (0 for an empty log)
    from_snapshot: int | None  # seq of the snapshot it started from
    events_folded: int


def fold_log(log: EventLog, at: int | None = None, use_snapshots: bool = True) -> Folded:
    """The state after event `at` (default: the last committed one), from the newest usable
    snapshot (one whose state does not load is ignored, as the log ignores one whose hash does
    not match: snapshots are caches); an event that fails to decode or fold raises FoldError
    naming its seq."""
    snapshot = log.load_snapshot(REDUCER_VERSION, max_seq=at) if use_snapshots else None
    state: State | None = None
    if snapshot is not None:
        try:
            state = state_from_bytes(snapshot.state)
        except Exception:  # noqa: BLE001 - a cache: one this code cannot read is not used
            snapshot = None
    start = snapshot.seq + 1 if snapshot else 1
    with paused_gc():
        state, count = fold_rows(state, log.read_bodies(start=start, stop=at), start, log.read_payloads)
    return Folded(state, start + count - 1, snapshot.seq if snapshot else None, count)


__all__ = ["Folded", "FoldError", "fold_log"]

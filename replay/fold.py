"""Fold a log into the orchestrator state, from the newest usable snapshot when there is one."""

from __future__ import annotations

from dataclasses import dataclass

from eventlog import EventLog
from orchestrator.core.events import decode_trusted
from orchestrator.core.evolve import evolve
from orchestrator.core.state import REDUCER_VERSION, State, state_from_bytes


@dataclass(frozen=True)
class Folded:
    state: State
    seq: int  # last event folded (0 for an empty log)
    from_snapshot: int | None  # seq of the snapshot it started from
    events_folded: int


class FoldError(ValueError):
    """An event the reducer cannot take (undecodable, or inconsistent with the state)."""

    def __init__(self, seq: int, kind: str, cause: Exception):
        detail = " ".join(str(cause).split())[:300] or type(cause).__name__
        super().__init__(f"seq {seq}: cannot fold the {kind!r} event: {type(cause).__name__}: {detail}")
        self.seq, self.kind, self.cause = seq, kind, cause


def fold_log(log: EventLog, at: int | None = None, use_snapshots: bool = True) -> Folded:
    """The state after event `at` (default: the last committed one), from the newest usable
    snapshot; an event that fails to decode or fold raises FoldError naming its seq."""
    snapshot = log.load_snapshot(REDUCER_VERSION, max_seq=at) if use_snapshots else None
    state = state_from_bytes(snapshot.state) if snapshot else State()
    seq = snapshot.seq if snapshot else 0
    count = 0
    for seq, _ts, kind, data in log.read_raw(start=seq + 1, stop=at):
        try:
            evolve(state, decode_trusted(kind, data))
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as err:
            raise FoldError(seq, kind, err) from err
        count += 1
    return Folded(state, seq, snapshot.seq if snapshot else None, count)

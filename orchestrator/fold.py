"""Fold a log into the orchestrator state, from the newest usable snapshot when there is one.

On the orchestrator side, beside the core: a resume (orchestrator.shell.runner) and every replay
command fold through it, and neither package imports the other for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from eventlog import CorruptLogError, LogError, Recorder
from orchestrator.core.arrays import PayloadError
from orchestrator.core.evolve import FoldError, fold_rows
from orchestrator.core.state import REDUCER_VERSION, State, state_from_bytes
from orchestrator.gc_tuning import paused_gc


@dataclass(frozen=True)
class Folded:
    state: State | None  # None for a log without events (a run stopped before its first commit)
    seq: int  # last event folded (0 for an empty log)
    from_snapshot: int | None  # seq of the snapshot it started from
    events_folded: int
    # With `keep_damaged`: the held traces, never shipped, whose payloads are lost (trace id ->
    # (its seq, why: the side file missing or damaged, or a payload that does not decode)).
    damaged: dict[int, tuple[int, str]] = field(default_factory=dict)


def fold_log(log: Recorder, at: int | None = None, use_snapshots: bool = True, keep_damaged: bool = False) -> Folded:
    """The state after event `at` (default: the last committed one), from the newest usable
    snapshot (one whose state does not load is ignored, as the log ignores one whose hash does
    not match: snapshots are caches); an event that fails to decode or fold raises FoldError
    naming its seq, and so does a held trace whose payload is lost (CorruptLogError for a side
    file), unless `keep_damaged`: the held traces never shipped are then left undecoded and
    listed in `Folded.damaged` (a shipped one still raises: shipped history is not dropped)."""
    snapshot = log.load_snapshot(REDUCER_VERSION, max_seq=at) if use_snapshots else None
    state: State | None = None
    if snapshot is not None:
        try:
            state = state_from_bytes(snapshot.state)
        except Exception:  # noqa: BLE001 - a cache: one this code cannot read is not used
            snapshot = None
    start = snapshot.seq + 1 if snapshot else 1
    unreadable: dict[int, str] = {}
    damaged: dict[int, tuple[int, str]] | None = {} if keep_damaged else None
    reader = payload_reader_around_damage(log, unreadable) if keep_damaged else log.read_payloads
    try:
        with paused_gc():
            state, count = fold_rows(state, log.read_bodies(start=start, stop=at), start, reader, damaged)
    except FoldError as err:
        if keep_damaged and (err.seq in unreadable or isinstance(err.cause, PayloadError)):
            why = unreadable.get(err.seq, str(err))  # a trace shipped and not yet trained
            raise CorruptLogError(
                f"{why}: a trace of a batch shipped and not yet trained, which --drop-damaged does not "
                "drop (shipped history is never rewritten); restore the payload file from a copy"
            ) from None
        raise
    lost = {trace_id: (seq, unreadable.get(seq, why)) for trace_id, (seq, why) in (damaged or {}).items()}
    return Folded(state, start + count - 1, snapshot.seq if snapshot else None, count, lost)


def payload_reader_around_damage(
    log: Recorder, unreadable: dict[int, str], around: tuple[type[LogError], ...] = (CorruptLogError,)
) -> Callable[[Iterable[int]], dict[int, bytes]]:
    """`log.read_payloads` that leaves out, rather than raises on, a payload whose side file is
    missing or damaged (or that raises another of `around`: an export reads past a dropped one),
    recording why in `unreadable` (seq -> the read's one line)."""

    def read(seqs: Iterable[int]) -> dict[int, bytes]:
        seqs = list(seqs)
        try:
            return log.read_payloads(seqs)
        except around:
            pass
        out: dict[int, bytes] = {}
        for seq in seqs:  # the damaged path only: one by one, to tell the lost from the rest
            try:
                out.update(log.read_payloads([seq]))
            except around as err:
                unreadable[seq] = str(err)
        return out

    return read

"""Events as a log stores them, for the tests that fold logged rows without a log."""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.core import events as ev
from orchestrator.core.evolve import PayloadReader, fold_rows
from orchestrator.core.state import State


def encoded_rows(events: Iterable, first_seq: int = 1) -> tuple[list[tuple[str, bytes]], PayloadReader]:
    """The (kind, data) rows of `events`, the first one at `first_seq`, and a reader of their
    payloads by seq, as `EventLog.read_bodies` and `read_payloads` give them."""
    rows, payloads = [], {}
    for seq, event in enumerate(events, first_seq):
        kind, data, payload = ev.encode_event(event)
        rows.append((kind, data))
        if payload is not None:
            payloads[seq] = payload
    return rows, lambda seqs: {seq: payloads[seq] for seq in seqs if seq in payloads}


def fold_encoded(state: State | None, events: Iterable, first_seq: int = 1) -> tuple[State | None, int]:
    """`fold_rows` over the rows of `events`."""
    rows, payloads = encoded_rows(events, first_seq)
    return fold_rows(state, rows, first_seq, payloads)

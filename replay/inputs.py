"""Telling a log's inputs from its decisions, and decoding rows, for --check and --reexecute.

The log stream is `[input, *decisions, input, *decisions, ...]`. An event's kind says which it
is, with one exception: `group_finalized` is an input when a background finalize delivered it,
and a decision when the inline path decided it. The inline path always emits it right after
its `finalize_started(background=False)` for the same group, so the row before tells.
"""

from __future__ import annotations

from collections.abc import Iterator

from orchestrator.core.events import INPUT_KINDS, decode_event
from replay.source import ReplayInputError, one_line, row_data


def is_inline_result(kind: str, seq: int, data: bytes, prev: tuple | None) -> bool:
    """True for a `group_finalized` decided inline (right after its finalize_started)."""
    if kind != "group_finalized" or prev is None or prev[2] != "finalize_started" or prev[0] != seq - 1:
        return False
    started = row_data(prev[0], prev[3])
    return started.get("background") is False and started.get("group_id") == row_data(seq, data).get("group_id")


def classify(rows: Iterator[tuple]) -> Iterator[tuple[bool, tuple]]:
    """(is_input, row) for each `(seq, ts, kind, data)` row, in order."""
    prev = None
    for row in rows:
        seq, _ts, kind, data = row
        yield kind in INPUT_KINDS and not is_inline_result(kind, seq, data, prev), row
        prev = row


def decode(row: tuple, path: str = ""):
    """The event model of a row; ReplayInputError (one line) if the row does not decode."""
    seq, _ts, kind, data = row
    try:
        return decode_event(kind, data)
    except ValueError as err:
        first = one_line(str(err) or type(err).__name__)[:300]
        raise ReplayInputError(f"{path}: seq {seq}: cannot decode the {kind!r} event: {first}") from None

"""Decoding a log's rows for --check and --reexecute.

Whether a row is an input or a decision is a property of its kind (`events.INPUT_KINDS`): a
background finalize's result is the input `background_finalized`, the inline path's the decision
`group_finalized`. Nothing is inferred from neighbouring rows.
"""

from __future__ import annotations

from orchestrator.core.events import decode_event
from replay.source import ReplayInputError, one_line


def decode(row: tuple, path: str = ""):
    """The event model of a row (`read_raw`'s, or `read_rows`' with its payload); ReplayInputError
    (one line) if the row does not decode."""
    seq, _ts, kind, data = row[:4]
    try:
        return decode_event(kind, data, row[4] if len(row) > 4 else None)
    except ValueError as err:
        first = one_line(str(err) or type(err).__name__)[:300]
        raise ReplayInputError(f"{path}: seq {seq}: cannot decode the {kind!r} event: {first}") from None

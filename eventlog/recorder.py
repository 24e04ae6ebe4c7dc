"""Recorder: what a run's loop and its fold need of an event log, whichever stores it.

EventLog (one SQLite file, durable) and MemoryLog (in memory) implement it; the loop appends,
commits and snapshots through it, and the fold reads it back. The tests of the contract run
over every recorder (tests/eventlog/test_eventlog_conformance.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol

__all__ = ["DroppedPayload", "Record", "Recorder", "Snapshot"]

# A fold's chunk: bodies are small, and a chunk is one statement's worth of rows.
BODIES_CHUNK = 16384


class Record(NamedTuple):
    """One committed event."""

    seq: int
    ts: float
    kind: str
    data: Any


class Snapshot(NamedTuple):
    """A verified reducer-state snapshot taken after event ``seq``."""

    seq: int
    reducer_version: str
    state_hash: str
    state: bytes


class DroppedPayload(NamedTuple):
    """What `read_rows(..., dropped_as_sha256=True)` yields for a payload dropped once no longer
    needed (`drop_payloads`): the sha256 of its bytes, which its row keeps."""

    sha256: str


def dropped_line(path: str, seq: int, sha256: str) -> str:
    """The one line a read of a dropped payload raises (PayloadDroppedError)."""
    return f"{path}: seq {seq}: its payload was dropped once no longer needed (its sha256 {sha256} is kept)"


class Recorder(Protocol):
    """An append-only event log: seqs 1, 2, ... given at append, made durable (where the recorder
    is durable) all at once by each commit; reads see committed events only."""

    @property
    def last_seq(self) -> int:
        """The last committed seq (0 when empty)."""
        ...

    def append_json(self, kind: str, data_json: bytes | str, payload: bytes | None = None) -> int:
        """Buffer one event, its data already encoded as JSON, with its binary payload if any;
        return its seq."""
        ...

    def commit(self) -> int:
        """Store every buffered event, all or nothing; return the last seq."""
        ...

    def read_bodies(
        self, start: int = 1, stop: int | None = None, chunk_size: int = BODIES_CHUNK
    ) -> Iterator[tuple[str, bytes]]:
        """``(kind, data_bytes)`` of every committed seq ``start..stop`` (inclusive; ``stop=None``:
        the last committed) in order: the i-th one is seq ``max(start, 1) + i``."""
        ...

    def read_payloads(self, seqs: Iterable[int]) -> dict[int, bytes]:
        """The payloads of the committed events ``seqs`` that have one, by seq; PayloadDroppedError
        (one line) for one that was dropped."""
        ...

    def drop_payloads(self, seqs: Iterable[int]) -> list[int]:
        """Drop the payloads of the committed events ``seqs``, each row keeping the sha256 of its
        payload's bytes; return the seqs dropped, in order (a row without a payload, or already
        dropped, is left as it is)."""
        ...

    def save_snapshot(self, seq: int, reducer_version: str, state: bytes) -> str:
        """Keep a state snapshot taken after committed event ``seq``; return its sha256 hex."""
        ...

    def load_snapshot(self, reducer_version: str, max_seq: int | None = None) -> Snapshot | None:
        """The newest snapshot of this reducer version at or before ``max_seq``, if any."""
        ...

    def close(self) -> None:
        """Close (idempotent); uncommitted appends are discarded, with a warning."""
        ...

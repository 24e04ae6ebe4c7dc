"""A recorder in memory with the writer API of EventLog: the same contract (seqs, atomic commits,
reads, snapshots), nothing durable. Benchmarks run the same pipeline with the SQLite log and with
this one to measure what durability costs; tests/eventlog/test_eventlog_conformance.py runs one
suite over both. It has no file, so none of what a file brings: meta, readers beside the writer,
row checksums, side files, reopening."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator
from time import time as _time
from types import TracebackType
from typing import Any

import orjson

from .codec import encode
from .errors import InvalidArgumentError, InvalidEventError, LogClosedError, PayloadDroppedError
from .log import payload_bytes
from .recorder import BODIES_CHUNK, DroppedPayload, Record, Recorder, Snapshot, dropped_line


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise InvalidArgumentError(f"chunk_size must be >= 1, not {chunk_size}")


def _refuse_dropped(seq: int, payload: bytes | DroppedPayload | None) -> bytes | None:
    if isinstance(payload, DroppedPayload):
        raise PayloadDroppedError(dropped_line(MemoryLog.path, seq, payload.sha256))
    return payload


class MemoryLog(Recorder):
    path = ":memory:"
    is_writer = True

    def __init__(self) -> None:
        # Committed; row i holds seq i + 1; a dropped payload is its DroppedPayload.
        self._rows: list[tuple[int, float, str, bytes, bytes | DroppedPayload | None]] = []
        self._buffer: list[tuple[int, float, str, bytes, bytes | DroppedPayload | None]] | None = []  # None once closed
        self._snapshots: dict[int, Snapshot] = {}

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def last_seq(self) -> int:
        self._open_buffer()
        return len(self._rows)

    @property
    def next_seq(self) -> int:
        return len(self._rows) + len(self._open_buffer()) + 1

    @property
    def pending(self) -> int:
        return len(self._buffer or ())

    def _open_buffer(self) -> list[tuple[int, float, str, bytes, bytes | DroppedPayload | None]]:
        if self._buffer is None:
            raise LogClosedError("the in-memory log is closed")
        return self._buffer

    # --- appending ---------------------------------------------------------------------------

    def append(self, kind: str, data: Any, payload: bytes | None = None) -> int:
        self._open_buffer()
        return self.append_json(kind, encode(data), payload)

    def append_json(self, kind: str, data_json: bytes | str, payload: bytes | None = None) -> int:
        # Inlined checks: this is the loop's hot path when a benchmark runs it instead of EventLog.
        buffer = self._buffer
        if buffer is None:
            raise LogClosedError("the in-memory log is closed")
        if type(kind) is not str or not kind:
            raise InvalidEventError(f"event kind must be a non-empty str, not {kind!r}")
        if isinstance(data_json, str):
            data = data_json.encode()
        else:
            try:
                data_json.decode()
            except (AttributeError, UnicodeDecodeError) as e:
                raise InvalidEventError(f"append_json needs UTF-8 JSON bytes: {e}") from None
            data = data_json if type(data_json) is bytes else bytes(data_json)
        seq = len(self._rows) + len(buffer) + 1
        buffer.append((seq, _time(), kind, data, payload_bytes(payload)))
        return seq

    def commit(self) -> int:
        buffer = self._open_buffer()
        self._rows.extend(buffer)
        buffer.clear()
        return len(self._rows)

    def discard(self) -> None:
        self._open_buffer().clear()

    # --- reading -------------------------------------------------------------------------------

    def _committed(
        self, start: int, stop: int | None
    ) -> list[tuple[int, float, str, bytes, bytes | DroppedPayload | None]]:
        """Committed rows of seqs start..stop (inclusive; stop None: the last one)."""
        self._open_buffer()
        first = max(int(start), 1)
        last = len(self._rows) if stop is None else min(stop, len(self._rows))
        return self._rows[first - 1 : last]

    def _of_kinds(
        self, start: int, stop: int | None, kinds: Iterable[str] | None, chunk_size: int
    ) -> list[tuple[int, float, str, bytes, bytes | DroppedPayload | None]]:
        _check_chunk_size(chunk_size)
        rows = self._committed(start, stop)
        if kinds is None:
            return rows
        wanted = {kinds} if isinstance(kinds, str) else set(kinds)
        return [row for row in rows if row[2] in wanted]

    def read_raw(
        self, start: int = 1, stop: int | None = None, kinds: Iterable[str] | None = None, chunk_size: int = 4096
    ) -> Iterator[tuple[int, float, str, bytes]]:
        for seq, ts, kind, data, _payload in self._of_kinds(start, stop, kinds, chunk_size):
            yield seq, ts, kind, data

    def read_rows(
        self,
        start: int = 1,
        stop: int | None = None,
        kinds: Iterable[str] | None = None,
        chunk_size: int = 256,
        dropped_as_sha256: bool = False,
    ) -> Iterator[tuple[int, float, str, bytes, bytes | DroppedPayload | None]]:
        for row in self._of_kinds(start, stop, kinds, chunk_size):
            if not dropped_as_sha256:
                _refuse_dropped(row[0], row[4])
            yield row

    def read_payloads(self, seqs: Iterable[int]) -> dict[int, bytes]:
        rows = self._committed(1, None)
        out: dict[int, bytes] = {}
        for seq in seqs:
            payload = _refuse_dropped(seq, rows[seq - 1][4]) if 1 <= seq <= len(rows) else None
            if payload is not None:
                out[seq] = payload
        return out

    def drop_payloads(self, seqs: Iterable[int]) -> list[int]:
        self._open_buffer()
        rows = self._rows
        dropped = sorted(seq for seq in set(seqs) if 1 <= seq <= len(rows) and type(rows[seq - 1][4]) is bytes)
        for seq in dropped:
            payload = rows[seq - 1][4]
            assert type(payload) is bytes  # as selected above
            rows[seq - 1] = (*rows[seq - 1][:4], DroppedPayload(hashlib.sha256(payload).hexdigest()))
        return dropped

    def read(
        self, start: int = 1, stop: int | None = None, kinds: Iterable[str] | None = None, chunk_size: int = 4096
    ) -> Iterator[Record]:
        for seq, ts, kind, data in self.read_raw(start, stop, kinds, chunk_size):
            yield Record(seq, ts, kind, orjson.loads(data))

    def read_bodies(
        self, start: int = 1, stop: int | None = None, chunk_size: int = BODIES_CHUNK
    ) -> Iterator[tuple[str, bytes]]:
        _check_chunk_size(chunk_size)
        for _seq, _ts, kind, data, _payload in self._committed(start, stop):
            yield kind, data

    # --- snapshots -------------------------------------------------------------------------------

    def save_snapshot(self, seq: int, reducer_version: str, state: bytes) -> str:
        self._open_buffer()
        if type(seq) is not int or not 0 <= seq <= len(self._rows):
            raise InvalidArgumentError(
                f"snapshot seq {seq!r} is not a committed seq (last committed is {len(self._rows)})"
            )
        state = bytes(state)
        digest = hashlib.sha256(state).hexdigest()
        self._snapshots[seq] = Snapshot(seq, str(reducer_version), digest, state)
        return digest

    def load_snapshot(self, reducer_version: str, max_seq: int | None = None) -> Snapshot | None:
        limit = self.last_seq if max_seq is None else min(self.last_seq, max_seq)
        usable = [s for s in self._snapshots.values() if s.reducer_version == reducer_version and s.seq <= limit]
        return max(usable, key=lambda s: s.seq, default=None)

    # --- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent. Uncommitted appends are discarded, with a warning."""
        if self._buffer:
            warnings.warn(
                f"closing the in-memory log with {len(self._buffer)} uncommitted events (discarded)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._buffer = None

    def __enter__(self) -> MemoryLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Commit pending appends on a clean exit, discard them on an exception; close."""
        try:
            if exc_type is None:
                self.commit()
            else:
                self.discard()
        finally:
            self.close()

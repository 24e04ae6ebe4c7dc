"""An in-memory stand-in with the writer API of EventLog, for measuring what durability costs
(benchmarks run the same pipeline with the SQLite log and with this list)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from .codec import encode
from .log import Snapshot


class MemoryLog:
    def __init__(self) -> None:
        self.rows: list[tuple[int, float, str, bytes]] = []
        self._buffer: list[tuple[int, float, str, bytes]] = []
        self.snapshots: list[Snapshot] = []

    @property
    def last_seq(self) -> int:
        return len(self.rows)

    @property
    def next_seq(self) -> int:
        return len(self.rows) + len(self._buffer) + 1

    def append(self, kind: str, data: Any) -> int:
        return self.append_json(kind, encode(data))

    def append_json(self, kind: str, data_json: bytes) -> int:
        seq = self.next_seq
        self._buffer.append((seq, time.time(), kind, data_json))
        return seq

    def commit(self) -> int:
        self.rows.extend(self._buffer)
        self._buffer.clear()
        return self.last_seq

    def read_raw(self, start: int = 1, stop: int | None = None, kinds=None, chunk_size: int = 4096):
        for row in self.rows[start - 1: stop]:
            if kinds is None or row[2] in kinds:
                yield row

    def save_snapshot(self, seq: int, reducer_version: str, state: bytes) -> str:
        digest = hashlib.sha256(state).hexdigest()
        self.snapshots.append(Snapshot(seq, reducer_version, digest, state))
        return digest

    def close(self) -> None:
        self._buffer.clear()

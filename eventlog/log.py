"""EventLog: an append-only, group-committed event log in one SQLite (WAL) file.

Design notes (why it looks like this):

* Appends are buffered in Python as ready-to-bind rows and inserted by
  multi-row ``INSERT`` statements inside one ``BEGIN IMMEDIATE`` transaction
  per :meth:`EventLog.commit`: the fsync cost is paid once per batch, and a
  batch is all-or-nothing.
* Sequence numbers are assigned at append time from a counter (the writer is
  the only writer, enforced by :class:`~eventlog.lock.WriterLock`), so callers
  know an event's seq before it is durable; a failed commit rolls it back.
* Reads use a separate connection and fetch bounded chunks, each its own
  short statement, so a reader never holds a transaction that would pin the
  WAL, and reading works while the writer appends. Every read of events in
  seq order goes through one path (:meth:`EventLog._scan`), which checks
  that no seq is missing.
* The WAL is kept bounded by SQLite's passive auto-checkpoint,
  ``journal_size_limit`` and, should readers starve those, an occasional
  TRUNCATE checkpoint with a short busy timeout.
"""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import itertools
import os
import sqlite3
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from . import fileformat
from .codec import NONFINITE, NOT_JSON, has_nonfinite
from .codec import OPTS as _OPTS
from .errors import (
    CorruptLogError,
    DamagedSnapshotsError,
    InvalidArgumentError,
    InvalidEventError,
    LogClosedError,
    LogError,
    LogExistsError,
    LogNotFoundError,
    NotWriterError,
    PayloadDroppedError,
    ReadOnlyLocationError,
    StorageError,
)
from .fileformat import data_hash as _data_hash
from .fileformat import data_seed as _data_seed
from .fileformat import dropped_ref, dropped_sha256
from .fileformat import finish_row_hash as _finish_row_hash
from .fileformat import stored_row_hash as _stored_row_hash
from .lock import WriterLock
from .recorder import BODIES_CHUNK, DroppedPayload, Record, Recorder, Snapshot, dropped_line
from .repair import rebuild_without_snapshots
from .sidefiles import SIDE_FILE_BYTES, read_side_payload, remove_orphans, side_dir, write_side_file

__all__ = ["DroppedPayload", "EventLog", "Record", "Snapshot", "VerifyReport"]

_SYNC = {"full": "FULL", "normal": "NORMAL"}
# A commit inserts its rows in multi-row statements of a power-of-two size, not one statement
# step per row (executemany): Python's sqlite3 lets go of the GIL around each step and must take
# it back afterwards, and while the event loop's thread is busy every take-back can wait for the
# interpreter's switch interval. 256 rows of at most 7 parameters stay under SQLite's limit on
# the parameters of one statement.
_MAX_ROWS_PER_INSERT = 256
_BUSY_TIMEOUT_S = 5.0
_MAX_SEQ = (1 << 63) - 1
# Passive auto-checkpoint every ~4 MiB of WAL (SQLite's default), and a WAL
# truncated back to this size whenever it is reset.
_WAL_AUTOCHECKPOINT_PAGES = (4 << 20) // fileformat.PAGE_SIZE
_JOURNAL_SIZE_LIMIT = 8 << 20
# Readers can starve the passive checkpoints (a reader tailing a busy writer always holds some
# frame), and the WAL then grows unbounded: past this size, force a TRUNCATE checkpoint; checked
# every _WAL_CHECK_EVERY commits (a stat call).
_WAL_FORCE_BYTES = 12 << 20
_WAL_CHECK_EVERY = 4
_FORCE_CHECKPOINT_BUSY_MS = 100

_time = time.time
_loads = orjson.loads
_dumps = orjson.dumps
_new_tuple = tuple.__new__


@dataclass
class VerifyReport:
    """Result of :meth:`EventLog.verify`; ``ok`` is True when ``problems`` is empty."""

    path: str
    events: int = 0
    last_seq: int = 0
    format_version: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise CorruptLogError with the first problem, if any."""
        if self.problems:
            more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            raise CorruptLogError(f"{self.path}: {self.problems[0]}{more}")


def _sync_pragma(durability: str) -> str:
    try:
        return _SYNC[durability]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"durability must be 'full' or 'normal', not {durability!r}") from None


def _check_meta_items(meta: dict[str, str] | None) -> dict[str, str]:
    meta = dict(meta or {})
    for key, value in meta.items():
        _check_meta_item(key, value)
    return meta


def _check_meta_item(key: str, value: str) -> None:
    if type(key) is not str or not isinstance(value, str):
        raise InvalidArgumentError(f"meta keys and values must be str, got {key!r}: {value!r}")
    if key in fileformat.RESERVED_META_KEYS:
        raise InvalidArgumentError(f"meta key {key!r} is reserved by the log format")


def _uri(path: str, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"{Path(path).absolute().as_uri()}?{query}"


class EventLog(Recorder):
    """A durable, append-only event log (see module docs). Not safe for concurrent
    use from several threads; one thread at a time (e.g. commit in a worker
    thread while the loop waits) is fine.

    Build one with :meth:`create`, :meth:`open` (the single writer) or
    :meth:`open_reader` (read-only, any number, never blocked by the writer).
    """

    # ------------------------------------------------------------ construction

    def __init__(
        self,
        path: str,
        conn: sqlite3.Connection,
        *,
        lock: WriterLock | None,
        durability: str | None,
        format_version: int = fileformat.FORMAT_VERSION,
    ):
        """Private: use create(), open() or open_reader()."""
        self.path = path
        self.durability = durability
        self._conn: sqlite3.Connection | None = conn
        self._rconn: sqlite3.Connection | None = None
        self._lock = lock
        self._writer = lock is not None
        self._buf: list[tuple] | None = [] if self._writer else None
        self._last = 0
        self._next = 1
        self._commits_since_wal_check = 0
        # Payloads longer than this go to a side file (eventlog.sidefiles); a setting of the writer.
        self.side_file_bytes = SIDE_FILE_BYTES
        self._pinned_end: int | None = None  # open_reader(pinned=True)
        # The writer's open rebuilt the file without its damaged snapshots: where the damaged one is.
        self.damaged_copy: str | None = None
        # A log of format 2 has no row checksums: its rows are read and written unchecked.
        self.format_version = format_version
        self.row_hashes = format_version >= fileformat.ROW_HASH_VERSION
        self._payload_expr = "payload, payload_ref" + (", row_hash" if self.row_hashes else ", NULL")
        if self._writer:
            self._last = self._committed_bounds(conn)
            self._next = self._last + 1

    @classmethod
    def create(cls, path: str | os.PathLike, meta: dict[str, str] | None = None, durability: str = "full") -> EventLog:
        """Create a new log at ``path`` and open it as the writer.

        The file is built under a temporary name and hard-linked into place, so
        ``path`` is either absent or a complete log, never a half-made one.
        Raises LogExistsError if ``path`` (or a leftover ``-wal``) exists.
        """
        path = os.fspath(path)
        sync = _sync_pragma(durability)
        meta = _check_meta_items(meta)
        cls._check_creatable(path)
        lock = WriterLock(path).acquire()
        try:
            cls._check_creatable(path)  # again, now that no other creator can race us
            cls._build_and_link(path, meta)
        except LogExistsError:
            lock.release()
            raise
        except BaseException:
            if os.path.lexists(path):  # made whole (its directory's fsync failed): a log to resume
                lock.release()
            else:
                lock.release_and_remove()  # nothing was made: nothing is left
            raise
        try:
            return cls._open_writer(path, sync, durability, lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike, durability: str = "full") -> EventLog:
        """Open an existing log as THE writer (takes the writer lock, fails at once if held)."""
        path = os.fspath(path)
        sync = _sync_pragma(durability)
        fileformat.check_header(path)
        lock = WriterLock(path).acquire()
        try:
            return cls._open_writer(path, sync, durability, lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open_reader(cls, path: str | os.PathLike, pinned: bool = False) -> EventLog:
        """Open an existing log read-only; never takes the writer lock.

        ``pinned``: every read stops at the last seq committed now, however far a live writer
        gets meanwhile (a stable view for a tool that reads a log several times, without holding
        a read transaction, which would pin the WAL).
        """
        log = cls._open_reader(os.fspath(path))
        if pinned:
            try:
                log._pinned_end = log.last_seq
            except BaseException:
                log.close()
                raise
        return log

    @classmethod
    def _open_reader(cls, path: str) -> EventLog:
        fileformat.check_header(path)
        conn = cls._connect_reader(path)
        try:
            try:
                version = fileformat.validate(conn, path)
            except ReadOnlyLocationError:
                conn.close()
                conn = cls._connect_immutable(path)
                version = fileformat.validate(conn, path)
            return cls(path, conn, lock=None, durability=None, format_version=version)
        except BaseException:
            conn.close()
            raise

    @classmethod
    def _connect_immutable(cls, path: str) -> sqlite3.Connection:
        """Read a log whose directory forbids creating the -shm file (read-only media).

        Only safe when no -wal holds frames: then the main file is the whole
        log, and nobody can be writing it, since no writer could create a WAL.
        """
        if fileformat.wal_has_frames(path) or os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise ReadOnlyLocationError(f"cannot read {path}: its -shm file cannot be created next to it")
        try:
            conn = sqlite3.connect(
                _uri(path, mode="ro", immutable="1"), uri=True, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise fileformat.translate(e, path) from None
        return conn

    @staticmethod
    def _check_creatable(path: str) -> None:
        if os.path.lexists(path):
            raise LogExistsError(f"{path} already exists")
        if os.path.lexists(path + "-wal"):
            raise LogExistsError(f"{path}-wal exists (leftover of an earlier log); remove it first")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise LogNotFoundError(f"cannot create {path}: directory {parent} does not exist")

    @staticmethod
    def _build_and_link(path: str, meta: dict[str, str]) -> None:
        """Write schema + meta into ``<path>.creating-<pid>``, fsync, link to ``path``."""
        tmp = f"{path}.creating-{os.getpid()}"
        _remove_build_files(tmp)
        try:
            fileformat.write_new_database(tmp, meta)
            fileformat.fsync_path(tmp)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise LogExistsError(f"{path} already exists") from None
            except OSError:  # no hard links here (some network/FUSE fs): rename instead
                if os.path.lexists(path):
                    raise LogExistsError(f"{path} already exists") from None
                os.rename(tmp, path)
            fileformat.fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)
        except PermissionError as e:
            raise ReadOnlyLocationError(f"cannot create {path}: {e.strerror}") from None
        except OSError as e:
            if e.errno == errno.EROFS:
                raise ReadOnlyLocationError(f"cannot create {path}: {e.strerror}") from None
            raise StorageError(f"cannot create {path}: {e.strerror or e}") from None
        finally:
            _remove_build_files(tmp)

    @classmethod
    def _open_writer(cls, path: str, sync: str, durability: str, lock: WriterLock) -> EventLog:
        _check_writable(path)
        _remove_stale_creation_files(path)
        conn = _connect_writer(path)
        repaired = None
        try:
            version = fileformat.validate(conn, path)
            try:  # before anything is written (orphans removed, WAL mode set)
                fileformat.check_damage(conn, path)
            except DamagedSnapshotsError:
                conn.close()
                repaired = rebuild_without_snapshots(path)
                conn = _connect_writer(path)
                version = fileformat.validate(conn, path)
                fileformat.check_damage(conn, path)
            _configure_writer(conn, sync, path)
            if os.path.isdir(side_dir(path)):
                remove_orphans(path, _referenced_side_files(conn))
            log = cls(path, conn, lock=lock, durability=durability, format_version=version)
        except BaseException:
            conn.close()
            raise
        log.damaged_copy = repaired
        return log

    @staticmethod
    def _connect_reader(path: str) -> sqlite3.Connection:
        """A read-only connection (mode=ro: it can never write, not even by mistake)."""
        try:
            conn = sqlite3.connect(
                _uri(path, mode="ro"), uri=True, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_S
            )
            conn.execute("PRAGMA query_only=1")
        except sqlite3.Error as e:
            raise fileformat.translate(e, path) from None
        return conn

    def _committed_bounds(self, conn: sqlite3.Connection) -> int:
        """Return the last committed seq; check the log starts at 1 (two O(log n) lookups)."""
        try:
            last = conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
            first = conn.execute("SELECT min(seq) FROM events").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise self._error(e) from None
        if first is not None and first != 1:
            raise CorruptLogError(f"{self.path}: first event has seq {first}, expected 1")
        return last

    # ------------------------------------------------------------ properties

    @property
    def is_writer(self) -> bool:
        return self._writer

    @property
    def closed(self) -> bool:
        return self._conn is None

    @property
    def last_seq(self) -> int:
        """Last committed seq (0 when empty). Live for readers, cached for the writer."""
        if self._writer:
            return self._last
        return self._end(self._live_conn())

    @property
    def next_seq(self) -> int:
        """Seq the next append will get (buffered appends count)."""
        return self._next if self._writer else self.last_seq + 1

    @property
    def pending(self) -> int:
        """Number of buffered, uncommitted events."""
        return len(self._buf) if self._buf else 0

    @property
    def meta(self) -> dict[str, str]:
        """The meta table as a dict (read fresh)."""
        conn = self._live_conn()
        try:
            return dict(conn.execute("SELECT key, value FROM meta"))
        except sqlite3.DatabaseError as e:
            raise self._error(e) from None

    # ------------------------------------------------------------ appending

    def append(self, kind: str, data: Any, payload: bytes | None = None) -> int:
        """Buffer one event (and its binary payload, if any) and return its seq: its data encoded
        as JSON, then buffered as :meth:`append_json` buffers a document; raise InvalidEventError
        for non-JSON data."""
        if self._buf is None:
            raise self._not_writable()
        # codec.encode, inlined: one call less per event.
        try:
            doc = _dumps(data, option=_OPTS)
        except TypeError as e:
            raise InvalidEventError(f"{NOT_JSON}: {e}") from None
        if b"null" in doc and has_nonfinite(data):
            raise InvalidEventError(NONFINITE)
        return self.append_json(kind, doc, payload)

    def append_json(self, kind: str, data_json: bytes | str, payload: bytes | None = None) -> int:
        """Buffer an already-encoded JSON document (trusted: not re-validated) and its binary
        payload, if any; return its seq.

        A row without a payload is buffered without its columns (see _insert_rows). A row's
        checksum is begun here, from its data's bytes: a row without a payload gets it whole; one
        with a payload gets its seed, finished at the commit (where a large payload gets its side
        file reference)."""
        buf = self._buf
        if buf is None:
            raise self._not_writable()
        if type(kind) is not str or not kind:
            raise InvalidEventError(f"event kind must be a non-empty str, not {kind!r}")
        try:
            if type(data_json) is bytes:  # the usual document, and every one append encodes
                doc = data_json
            elif isinstance(data_json, str):
                doc = data_json.encode()
            else:
                doc = bytes(data_json)
            text = doc.decode()
        except (TypeError, UnicodeError) as e:
            raise InvalidEventError(f"append_json needs UTF-8 JSON bytes: {e}") from None
        seq = self._next
        if payload is None:
            if self.row_hashes:
                row: tuple = (seq, _time(), kind, text, _data_hash(kind, doc))
            else:
                row = (seq, _time(), kind, text)
        elif self.row_hashes:
            row = (seq, _time(), kind, text, payload_bytes(payload), None, _data_seed(kind, doc))
        else:
            row = (seq, _time(), kind, text, payload_bytes(payload), None)
        buf.append(row)
        self._next = seq + 1
        return seq

    def commit(self) -> int:
        """Durably write every buffered event in one transaction; return the last seq.

        All-or-nothing: on failure nothing is stored, the buffer is discarded,
        next_seq rolls back to last_seq + 1 and the error propagates.
        """
        buf = self._buf
        if buf is None:
            raise self._not_writable()
        if not buf:
            return self._last
        self._buf = []
        try:
            with_payload = [i for i, row in enumerate(buf) if len(row) > 5]
            large = [i for i in with_payload if len(buf[i][4]) > self.side_file_bytes]
            if large:  # durable in their side file before the transaction that references them
                refs = write_side_file(self.path, [buf[i][4] for i in large])
                for i, ref in zip(large, refs, strict=True):
                    buf[i] = (*buf[i][:4], None, ref, *buf[i][6:])
            if self.row_hashes:  # a row with a payload has its checksum's seed: finished here
                for i in with_payload:
                    seq, ts, kind, text, payload, ref, seed = buf[i]
                    buf[i] = (seq, ts, kind, text, payload, ref, _finish_row_hash(seed, payload, ref))
            self._transact(lambda conn: _insert_rows(conn, buf))
        except BaseException:
            self._rederive_seq()
            raise
        self._last = buf[-1][0]
        self._commits_since_wal_check += 1
        if self._commits_since_wal_check >= _WAL_CHECK_EVERY:
            self._bound_wal()
        return self._last

    def discard(self) -> None:
        """Drop every buffered event; next_seq returns to last_seq + 1."""
        if self._buf is None:
            raise self._not_writable()
        self._buf = []
        self._next = self._last + 1

    def _rederive_seq(self) -> None:
        """After a failed commit: the seq counter follows what is actually stored."""
        try:
            self._last = self._live_conn().execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        except sqlite3.Error:
            pass  # the original error is the one worth reporting
        self._next = self._last + 1

    # ------------------------------------------------------------ reading

    def read(
        self, start: int = 1, stop: int | None = None, kinds: Iterable[str] | None = None, chunk_size: int = 4096
    ) -> Iterator[Record]:
        """Yield committed events ``start..stop`` (inclusive) in seq order, data decoded.

        ``stop=None`` means the last seq committed when iteration starts; ``kinds`` keeps the
        events of those kinds only. Streams in chunks of ``chunk_size`` rows (see :meth:`_scan`).
        """
        # Decoded row by row as they are taken, so each record's objects are freed before the next
        # is built rather than a chunk of them held at once. The events before a damaged row are
        # still yielded; the damaged one raises.
        for rows in self._scan(start, stop, kinds, chunk_size, "seq, ts, kind, data"):
            for seq, ts, kind, data in rows:
                try:
                    decoded = _loads(data)
                except orjson.JSONDecodeError as e:
                    message = f"{self.path} is corrupted: the data of seq {seq} is not JSON ({e})"
                    raise CorruptLogError(message) from None
                yield _new_tuple(Record, (seq, ts, kind, decoded))

    def read_raw(
        self, start: int = 1, stop: int | None = None, kinds: Iterable[str] | None = None, chunk_size: int = 4096
    ) -> Iterator[tuple[int, float, str, bytes]]:
        """Like :meth:`read` but yields ``(seq, ts, kind, data_bytes)`` without decoding."""
        for rows in self._scan(start, stop, kinds, chunk_size, "seq, ts, kind, CAST(data AS BLOB)"):
            yield from rows

    def read_rows(
        self,
        start: int = 1,
        stop: int | None = None,
        kinds: Iterable[str] | None = None,
        chunk_size: int = 256,
        dropped_as_sha256: bool = False,
    ) -> Iterator[tuple[int, float, str, bytes, Any]]:
        """Like :meth:`read_raw`, each row with its payload: ``(seq, ts, kind, data_bytes,
        payload or None)``. Payloads can be large: the chunks are small. A dropped payload raises
        PayloadDroppedError, or with ``dropped_as_sha256`` is its DroppedPayload (its row checked
        all the same)."""
        columns = f"seq, ts, kind, CAST(data AS BLOB), {self._payload_expr}"
        for rows in self._scan(start, stop, kinds, chunk_size, columns):
            for seq, ts, kind, data, payload, ref, check in rows:
                sha = dropped_sha256(ref) if dropped_as_sha256 else None
                if sha is not None:
                    self._check_row(seq, kind, data, payload, ref, check)
                    yield seq, ts, kind, data, DroppedPayload(sha)
                else:
                    yield seq, ts, kind, data, self._checked_payload(seq, kind, data, payload, ref, check)

    def read_bodies(
        self, start: int = 1, stop: int | None = None, chunk_size: int = BODIES_CHUNK
    ) -> Iterator[tuple[str, bytes]]:
        """Yield ``(kind, data_bytes)`` for every committed seq ``start..stop`` in order: the row
        of seq ``max(start, 1) + i`` is the i-th one. For folds, which need no seq or timestamp
        per row: fewer columns fetched, fewer objects built."""
        for rows in self._scan(start, stop, None, chunk_size, "kind, CAST(data AS BLOB)"):
            yield from rows

    def _scan(
        self, start: int, stop: int | None, kinds: Iterable[str] | None, chunk_size: int, columns: str
    ) -> Iterator[list[tuple]]:
        """The one read of events in seq order: ``columns`` of the committed rows ``start..stop``
        (``stop=None``: the last seq committed when iteration starts), in chunks of at most
        ``chunk_size`` rows, each a separate, complete statement.

        Unfiltered, each chunk is the seq range ``cursor..cursor + chunk_size - 1`` (cut at
        ``stop``), and a missing seq in it raises CorruptLogError: below the last seq, every seq is
        stored. With ``kinds``, no seq can be expected, so there is no such check, and ``columns``
        begins with ``seq``: the next chunk starts after the last row's."""
        if chunk_size < 1:
            raise InvalidArgumentError(f"chunk_size must be >= 1, not {chunk_size}")
        conn = self._read_conn()
        if kinds is None:
            kinds = ()
        else:
            kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
            if not kinds:  # an empty filter matches nothing
                return
        sql = f"SELECT {columns} FROM events WHERE seq >= ? AND seq <= ?"
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
        sql += " ORDER BY seq LIMIT ?"
        end = self._end(conn)
        stop = end if stop is None else min(stop, end)
        cursor = max(int(start), 1)
        while cursor <= stop:
            upper = stop if kinds else min(stop, cursor + chunk_size - 1)
            try:
                rows = conn.execute(sql, (cursor, upper, *kinds, chunk_size)).fetchall()
            except sqlite3.DatabaseError as e:
                raise self._error(e) from None
            if kinds:
                if rows:
                    yield rows
                if len(rows) < chunk_size:
                    return
                cursor = rows[-1][0] + 1
                continue
            if len(rows) != upper - cursor + 1:  # distinct seqs in cursor..upper: all, or a gap
                missing = "not contiguous" if rows else "missing"
                raise CorruptLogError(f"{self.path}: seqs {cursor}..{upper} are {missing}")
            yield rows
            cursor = upper + 1

    def read_payloads(self, seqs: Iterable[int]) -> dict[int, bytes]:
        """The payloads of the committed events ``seqs`` (those that have one), by seq."""
        conn = self._read_conn()
        wanted = sorted(set(seqs))
        end = self._end(conn)
        out: dict[int, bytes] = {}
        for first in range(0, len(wanted), _MAX_ROWS_PER_INSERT):
            chunk = [seq for seq in wanted[first : first + _MAX_ROWS_PER_INSERT] if seq <= end]
            sql = (
                f"SELECT seq, kind, CAST(data AS BLOB), {self._payload_expr} FROM events"
                f" WHERE (payload IS NOT NULL OR payload_ref IS NOT NULL) AND seq IN ({','.join('?' * len(chunk))})"
            )
            try:
                rows = conn.execute(sql, chunk).fetchall() if chunk else []
            except sqlite3.DatabaseError as e:
                raise self._error(e) from None
            for seq, kind, data, payload, ref, check in rows:
                checked = self._checked_payload(seq, kind, data, payload, ref, check)
                if checked is not None:  # always, by the query: a row with a payload or its reference
                    out[seq] = checked
        return out

    def _checked_payload(
        self, seq: int, kind: str, data: bytes, payload: bytes | None, ref: str | None, check: int | None
    ) -> bytes | None:
        """A row's payload, the row checked against its `row_hash` (a log of format 2 has none:
        read unchecked), a side file's piece against the sha256 its reference holds."""
        self._check_row(seq, kind, data, payload, ref, check)
        if ref is None:
            return payload
        sha = dropped_sha256(ref)
        if sha is not None:
            raise PayloadDroppedError(dropped_line(self.path, seq, sha))
        return read_side_payload(self.path, seq, ref)

    def _check_row(
        self, seq: int, kind: str, data: bytes, payload: bytes | None, ref: str | None, check: int | None
    ) -> None:
        if self.row_hashes and check != _stored_row_hash(kind, data, payload, ref):
            raise CorruptLogError(row_damage(self.path, seq, check))

    def drop_payloads(self, seqs: Iterable[int]) -> list[int]:
        """Drop the payloads of the committed rows ``seqs`` in one transaction: each row's
        ``payload`` becomes NULL and its ``payload_ref`` ``dropped:<sha256 of the payload>``, its
        checksum taken again over that reference (docs/log-format.md, "Dropped token arrays"), so
        the row still verifies and still says what it held. Return the seqs dropped, in order. A
        row without a payload, or already dropped, is left as it is; so is one that fails its
        checksum: its damage is named by the reads and checks that find it, never hashed over. A
        side file every piece of which is dropped is deleted after the commit (a crash in
        between leaves it unreferenced: the next writer's open deletes it)."""
        self._require_writer()
        wanted = sorted({seq for seq in seqs if 1 <= seq <= self._last})
        dropped: list[tuple] = []
        side_files: set[str] = set()

        def work(conn: sqlite3.Connection) -> None:
            dropped.clear()
            side_files.clear()
            for first in range(0, len(wanted), _MAX_ROWS_PER_INSERT):
                chunk = wanted[first : first + _MAX_ROWS_PER_INSERT]
                marks = ",".join("?" * len(chunk))
                sql = (  # a row dropped already is not read again (a resume's pass asks for them all)
                    f"SELECT seq, ts, kind, CAST(data AS BLOB), {self._payload_expr} FROM events"
                    " WHERE (payload IS NOT NULL OR payload_ref IS NOT NULL)"
                    f" AND coalesce(payload_ref, '') NOT LIKE '{fileformat.DROPPED_PREFIX}%' AND seq IN ({marks})"
                )
                stored = (self._dropped_row(row, side_files) for row in conn.execute(sql, chunk).fetchall())
                rows = [row for row in stored if row is not None]
                # Deleted and inserted again, not updated in place: an UPDATE that shrinks a row
                # leaves its b-tree page as sparse as it made it, while a delete lets SQLite merge
                # the emptied pages, so the file stops growing (bench/test_rundir_bench.py).
                conn.executemany("DELETE FROM events WHERE seq = ?", [(row[0],) for row in rows])
                _insert_rows(conn, rows)
                dropped.extend(rows)

        self._transact(work)
        if side_files:
            remove_orphans(self.path, _referenced_side_files(self._live_conn()))
        return [row[0] for row in dropped]

    def _dropped_row(self, row: tuple, side_files: set[str]) -> tuple | None:
        """The row as a drop stores it (payload NULL, its reference `dropped:<sha256>`, its
        checksum over that); None for a row left as it is."""
        seq, ts, kind, data, payload, ref, check = row
        if self.row_hashes and check != _stored_row_hash(kind, data, payload, ref):
            return None  # damage stays visible as damage: a new checksum would hide it
        if ref is None:
            sha = hashlib.sha256(payload).hexdigest()
        else:  # name:offset:length:sha256, checked by the row's checksum
            parts = ref.split(":")
            if len(parts) != 4:
                return None  # not a reference this code wrote: its read names it
            side_files.add(parts[0])
            sha = parts[3]
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return None  # not what an append stores: damage, named where it is read
        new_ref = dropped_ref(sha)
        if not self.row_hashes:
            return (seq, ts, kind, text, None, new_ref)
        return (seq, ts, kind, text, None, new_ref, _stored_row_hash(kind, data, None, new_ref))

    def damaged_rows(self, stop: int | None = None, payloads_only: bool = False) -> dict[int, str]:
        """Every row (seqs up to ``stop``; ``payloads_only``: of the rows with a payload) whose
        kind, data or payload fails its checksum, by seq, with the one line that names it; empty
        for a log of format 2 (no checksums). Reads every such row (a side file's reference, not
        the file): a resume runs it over the payloads before appending, as it runs SQLite's
        quick_check."""
        if not self.row_hashes:
            return {}
        conn = self._read_conn()
        end = self._end(conn) if stop is None else min(stop, self._end(conn))
        sql = (
            "SELECT seq, kind, CAST(data AS BLOB), payload, payload_ref, row_hash FROM events WHERE seq <= ?"
            + (" AND (payload IS NOT NULL OR payload_ref IS NOT NULL)" if payloads_only else "")
            + " ORDER BY seq"
        )
        damaged: dict[int, str] = {}
        try:
            for seq, kind, data, payload, ref, check in conn.execute(sql, (end,)):
                if check != _stored_row_hash(kind, data, payload, ref):
                    damaged[seq] = row_damage(self.path, seq, check)
        except sqlite3.DatabaseError as e:
            raise self._error(e) from None
        return damaged

    # ------------------------------------------------------------ meta

    def set_meta(self, key: str, value: str) -> None:
        """Set one meta entry durably (its own transaction, independent of the buffer)."""
        self._require_writer()
        _check_meta_item(key, value)
        self._write("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------ snapshots

    def save_snapshot(self, seq: int, reducer_version: str, state: bytes) -> str:
        """Store a state snapshot taken after committed event ``seq``; return its sha256 hex.

        A snapshot is a cache: one per seq (a newer save at the same seq replaces it).
        """
        self._require_writer()
        if type(seq) is not int or not 0 <= seq <= self._last:
            raise InvalidArgumentError(f"snapshot seq {seq!r} is not a committed seq (last committed is {self._last})")
        state = bytes(state)
        state_hash = hashlib.sha256(state).hexdigest()
        self._write(
            "INSERT OR REPLACE INTO snapshots(seq, reducer_version, state_hash, state) VALUES (?, ?, ?, ?)",
            (seq, str(reducer_version), state_hash, state),
        )
        return state_hash

    def load_snapshot(self, reducer_version: str, max_seq: int | None = None) -> Snapshot | None:
        """Newest snapshot with this reducer version, seq <= max_seq and a verifying hash.

        Snapshots of other reducer versions, with a bad hash, or past the last
        committed event are ignored (they are caches).
        """
        conn = self._read_conn()
        limit = self._end(conn)
        if max_seq is not None:
            limit = min(limit, max_seq)
        try:
            rows = conn.execute(
                "SELECT seq, reducer_version, state_hash, state FROM snapshots"
                " WHERE reducer_version = ? AND seq <= ? ORDER BY seq DESC",
                (reducer_version, limit),
            )
            for seq, version, state_hash, state in rows:
                if state is not None and hashlib.sha256(state).hexdigest() == state_hash:
                    rows.close()
                    return Snapshot(seq, version, state_hash, bytes(state))
        except sqlite3.DatabaseError as e:
            error = self._error(e)
            if isinstance(error, CorruptLogError):
                return None  # a damaged snapshots table: a cache, folded around (the events are checked as read)
            raise error from None
        return None

    # ------------------------------------------------------------ maintenance

    def verify(self) -> VerifyReport:
        """Full check: PRAGMA integrity_check, format marks, seq contiguous from 1, every side-file
        payload present with its sha256 (a dropped payload has none to check: its row's checksum
        covers the sha256 it keeps)."""
        report = VerifyReport(self.path)
        conn = self._read_conn()
        try:
            conn.execute("BEGIN")  # one consistent view for every check below
            try:
                _check_integrity(conn, report)
                _check_format(conn, report)
                _check_contiguity(conn, report, self._pinned_end)
                _check_side_files(conn, report, self._pinned_end)
                _check_row_hashes(self, report)
            finally:
                conn.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            report.problems.append(f"unreadable: {e}")
        return report

    def check_damage(self) -> None:
        """SQLite's ``PRAGMA quick_check`` of the file, as every writer's open runs it:
        CorruptLogError (DamagedSnapshotsError when only the snapshots are damaged) naming the
        first problem. A damaged b-tree can hide rows from a read without an error."""
        fileformat.check_damage(self._read_conn(), self.path)

    def checkpoint(self, mode: str = "TRUNCATE") -> tuple[int, int, int]:
        """Run a WAL checkpoint; return SQLite's (busy, wal_frames, checkpointed_frames).

        TRUNCATE/RESTART wait (up to the busy timeout) for readers to move on.
        """
        self._require_writer()
        mode = mode.upper()
        if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
            raise InvalidArgumentError(f"unknown checkpoint mode {mode!r}")
        try:
            return tuple(self._live_conn().execute(f"PRAGMA wal_checkpoint({mode})").fetchone())
        except sqlite3.Error as e:
            raise self._error(e) from None

    def _bound_wal(self) -> None:
        """Force a TRUNCATE checkpoint if passive ones have been starved by readers."""
        self._commits_since_wal_check = 0
        try:
            if os.path.getsize(self.path + "-wal") <= _WAL_FORCE_BYTES:
                return
        except OSError:
            return
        conn = self._live_conn()
        try:
            # Short busy wait: the appending loop must not stall behind a slow reader.
            conn.execute(f"PRAGMA busy_timeout={_FORCE_CHECKPOINT_BUSY_MS}")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass  # a later commit retries; the data is safe either way
        finally:
            conn.execute(f"PRAGMA busy_timeout={int(_BUSY_TIMEOUT_S * 1000)}")

    def close(self) -> None:
        """Close the log (idempotent). Uncommitted appends are discarded, with a warning."""
        if self._conn is None:
            return
        if self._buf:
            warnings.warn(
                f"closing {self.path} with {len(self._buf)} uncommitted events (discarded)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._buf = None
        for conn in (self._rconn, self._conn):
            if conn is not None:
                conn.close()
        self._rconn = self._conn = None
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Commit pending appends on a clean exit, discard them on an exception; close."""
        try:
            if exc_type is None and self._buf:
                self.commit()
            elif self._buf:
                self.discard()
        finally:
            self.close()

    def __repr__(self) -> str:
        role = "closed" if self.closed else ("writer" if self._writer else "reader")
        return f"<EventLog {self.path!r} {role} last_seq={self._last if self._writer else '?'}>"

    # ------------------------------------------------------------ helpers

    def _live_conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LogClosedError(f"{self.path}: the log handle is closed")
        return self._conn

    def _read_conn(self) -> sqlite3.Connection:
        """The connection reads go through: the reader's own, or the writer's second one."""
        conn = self._live_conn()
        if not self._writer:
            return conn
        if self._rconn is None:
            self._rconn = self._connect_reader(self.path)
        return self._rconn

    def _end(self, conn: sqlite3.Connection) -> int:
        """The last seq a read may return: the last committed, or the pinned one."""
        if self._pinned_end is not None:
            return self._pinned_end
        return self._query_one("SELECT coalesce(max(seq), 0) FROM events", conn)

    def _query_one(self, sql: str, conn: sqlite3.Connection | None = None) -> Any:
        conn = conn or self._live_conn()
        try:
            return conn.execute(sql).fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise self._error(e) from None

    def _write(self, sql: str, params: tuple) -> None:
        """Run one statement in its own BEGIN IMMEDIATE transaction."""
        self._transact(lambda conn: conn.execute(sql, params))

    def _transact(self, work: Callable[[sqlite3.Connection], object]) -> None:
        """Run ``work(conn)`` in one BEGIN IMMEDIATE transaction. On any failure it is rolled
        back and the error propagates (SQLite errors as typed LogErrors)."""
        conn = self._live_conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            work(conn)
            conn.execute("COMMIT")
        except BaseException as e:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the original error is the one worth reporting
            if isinstance(e, sqlite3.Error):
                raise self._error(e) from e
            raise

    def _require_writer(self) -> None:
        if not self._writer or self._conn is None:
            raise self._not_writable()

    def _not_writable(self) -> LogError:
        if self._conn is None:
            return LogClosedError(f"{self.path}: the log handle is closed")
        return NotWriterError(f"{self.path} is open read-only (open_reader); writes need EventLog.open")

    def _error(self, exc: sqlite3.Error) -> Exception:
        return fileformat.translate(exc, self.path)


# ---------------------------------------------------------------- module helpers


def row_damage(path: str, seq: int, check: int | None) -> str:
    """The one line naming a row whose data or payload fails its checksum."""
    if check is None:
        return f"{path} is damaged: seq {seq}: its row has no checksum (row_hash is NULL)"
    return f"{path} is damaged: seq {seq}: its data or payload fails its checksum (row_hash {check})"


def payload_bytes(payload: Any) -> bytes | None:
    """A payload as stored: bytes (a bytes-like object is copied into bytes), or None."""
    if payload is None or type(payload) is bytes:
        return payload
    try:
        return bytes(memoryview(payload))
    except TypeError:
        raise InvalidEventError(f"an event payload must be bytes, not {type(payload).__name__}") from None


_COLUMNS = {
    4: "seq, ts, kind, data",
    5: "seq, ts, kind, data, row_hash",
    6: "seq, ts, kind, data, payload, payload_ref",
    7: "seq, ts, kind, data, payload, payload_ref, row_hash",
}


@functools.cache
def _insert_sql(n_rows: int, n_columns: int = 6) -> str:
    row = "(" + ",".join("?" * n_columns) + ")"
    return f"INSERT INTO events({_COLUMNS[n_columns]}) VALUES " + ",".join([row] * n_rows)


def _insert_rows(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """Insert (seq, ts, kind, data[, row_hash]) rows and (seq, ts, kind, data, payload, payload_ref[, row_hash]) rows,
    each shape in as few multi-row statements as power-of-two sizes allow. Rows without a payload
    leave its columns out (NULL by default), so a commit of small events binds only what it
    stores."""
    plain = [row for row in rows if len(row) < 6]
    with_payload = [] if len(plain) == len(rows) else [row for row in rows if len(row) >= 6]
    for shape in (plain, with_payload):
        n_columns = len(shape[0]) if shape else 0
        start, left = 0, len(shape)
        while left:
            size = min(_MAX_ROWS_PER_INSERT, 1 << (left.bit_length() - 1))
            params = tuple(itertools.chain.from_iterable(shape[start : start + size]))
            conn.execute(_insert_sql(size, n_columns), params)
            start, left = start + size, left - size


def _remove_build_files(tmp: str) -> None:
    """Delete the file a log is built in, ``tmp``, and SQLite's files beside it, where present."""
    for leftover in (tmp, tmp + "-journal", tmp + "-wal", tmp + "-shm"):
        if os.path.lexists(leftover):
            os.unlink(leftover)


def _remove_stale_creation_files(path: str) -> None:
    """Delete ``<path>.creating-*`` left by a creator that was killed mid-create.

    Safe only under the writer lock: a live creator holds it while building.
    """
    for leftover in glob.glob(glob.escape(path) + ".creating-*"):
        try:
            os.unlink(leftover)
        except OSError:
            pass


def _connect_writer(path: str) -> sqlite3.Connection:
    try:
        return sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_S)
    except sqlite3.Error as e:
        raise fileformat.translate(e, path) from None


def _check_writable(path: str) -> None:
    """Fail clearly if the file cannot be opened for writing.

    SQLite would silently fall back to a read-only connection, and the first
    commit would fail much later, far from the cause.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise LogNotFoundError(f"no event log at {path}") from None
    except OSError as e:
        raise ReadOnlyLocationError(f"cannot open {path} for writing: {e.strerror}") from None
    os.close(fd)


def _configure_writer(conn: sqlite3.Connection, sync: str, path: str) -> None:
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        conn.execute(f"PRAGMA synchronous={sync}")
        conn.execute(f"PRAGMA wal_autocheckpoint={_WAL_AUTOCHECKPOINT_PAGES}")
        conn.execute(f"PRAGMA journal_size_limit={_JOURNAL_SIZE_LIMIT}")
        # Take and drop the write lock once: fails here, with a clear error, if the
        # location is read-only, rather than at the first commit.
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise fileformat.translate(e, path) from None
    if mode.lower() != "wal":
        raise ReadOnlyLocationError(f"cannot put {path} in WAL mode (journal_mode is {mode})")


def _check_integrity(conn: sqlite3.Connection, report: VerifyReport) -> None:
    rows = [r[0] for r in conn.execute("PRAGMA integrity_check")]
    if rows != ["ok"]:
        report.problems.extend(f"integrity: {r}" for r in rows)


def _check_format(conn: sqlite3.Connection, report: VerifyReport) -> None:
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    if meta.get("magic") != fileformat.MAGIC:
        report.problems.append("meta.magic is missing or wrong: not an orch event log")
    try:
        report.format_version = fileformat.check_version(meta.get("format_version"), report.path)
    except LogError as e:
        report.problems.append(str(e))


def _referenced_side_files(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT DISTINCT substr(payload_ref, 1, instr(payload_ref, ':') - 1) FROM events"
        f" WHERE payload_ref IS NOT NULL AND payload_ref NOT LIKE '{fileformat.DROPPED_PREFIX}%'"
    )
    return {name for (name,) in rows}


def _check_side_files(conn: sqlite3.Connection, report: VerifyReport, up_to: int | None) -> None:
    rows = conn.execute(
        "SELECT seq, payload_ref FROM events WHERE payload_ref IS NOT NULL AND seq <= ?"
        f" AND payload_ref NOT LIKE '{fileformat.DROPPED_PREFIX}%' ORDER BY seq",
        (_MAX_SEQ if up_to is None else up_to,),
    )
    for seq, ref in rows:
        try:
            read_side_payload(report.path, seq, ref)
        except CorruptLogError as err:
            report.problems.append(str(err).removeprefix(f"{report.path}: "))


def _check_row_hashes(log: EventLog, report: VerifyReport) -> None:
    """Every row's checksum; rows too damaged to read are a problem reported, not raised."""
    try:
        damaged = log.damaged_rows(log._pinned_end)
    except LogError as e:
        report.problems.append(f"row checksums unreadable: {str(e).removeprefix(f'{report.path} is corrupted: ')}")
        return
    report.problems.extend(why.removeprefix(f"{report.path} is damaged: ") for why in damaged.values())


def _check_contiguity(conn: sqlite3.Connection, report: VerifyReport, up_to: int | None) -> None:
    """Seqs 1..last with no gap; `up_to` (a pinned reader's end) bounds what is checked."""
    count, first, last = conn.execute(
        "SELECT count(*), min(seq), max(seq) FROM events WHERE seq <= ?", (_MAX_SEQ if up_to is None else up_to,)
    ).fetchone()
    report.events, report.last_seq = count, last or 0
    if count == 0:
        return
    if first != 1:
        report.problems.append(f"seq starts at {first}, expected 1")
    if count != last - first + 1:
        gap = conn.execute(
            "SELECT e.seq + 1 FROM events e WHERE e.seq < ? AND NOT EXISTS"
            " (SELECT 1 FROM events n WHERE n.seq = e.seq + 1) ORDER BY e.seq LIMIT 1",
            (last,),
        ).fetchone()
        report.problems.append(f"seq gap: {last - first + 1 - count} missing, first missing seq {gap[0]}")

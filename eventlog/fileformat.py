"""On-disk format: schema, meta keys, and the checks that classify a bad file.

The format is public (docs/log-format.md): users query it with any SQLite tool, so the
schema stays plain and the identifying marks live in the ``meta`` table.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import struct

from xxhash import xxh3_64_intdigest as _xxh3

from .errors import (
    CorruptLogError,
    DamagedSnapshotsError,
    ForeignDatabaseError,
    LogError,
    LogNotFoundError,
    NewerFormatError,
    NotSQLiteError,
    OlderFormatError,
    ReadOnlyLocationError,
    StorageError,
)

MAGIC = "orch-eventlog"
# 2: each event has a binary `payload` beside its JSON `data` (NULL for most events): in its
# `payload` column, or over SIDE_FILE_BYTES in a side file that its `payload_ref` names.
# 3: each row has its checksum, `row_hash`, over its data and its payload (or payload reference).
FORMAT_VERSION = 3
# The first format whose rows carry their checksum.
ROW_HASH_VERSION = 3
# The oldest format this code reads: a version 2 log is read and resumed as it was written, its
# payloads unchecked (docs/log-format.md).
OLDEST_READ_VERSION = 2
RESERVED_META_KEYS = frozenset({"magic", "format_version"})

SCHEMA = (
    "CREATE TABLE events(seq INTEGER PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL,"
    " payload BLOB, payload_ref TEXT, row_hash INTEGER)",
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE snapshots(seq INTEGER PRIMARY KEY, reducer_version TEXT, state_hash TEXT, state BLOB)",
)

# A dropped payload's `payload_ref` (docs/log-format.md, "Dropped token arrays"): this prefix,
# then the sha256 of the payload's bytes. A side file's reference starts with 64 hex digits, never
# with this.
DROPPED_PREFIX = "dropped:"


def dropped_ref(sha256_hex: str) -> str:
    return DROPPED_PREFIX + sha256_hex


def dropped_sha256(ref: str | None) -> str | None:
    """The sha256 a dropped payload's reference keeps; None for any other reference."""
    return ref[len(DROPPED_PREFIX) :] if ref is not None and ref.startswith(DROPPED_PREFIX) else None


# New logs use 16 KiB pages: a sequential read of the log (a fold) walks a quarter as many
# pages as with SQLite's 4 KiB default (bench/test_replay_bench.py measures the fold).
PAGE_SIZE = 16384


def row_hash(kind: str, data: bytes, payload: bytes | None) -> int:
    """A row's checksum (its `row_hash`): XXH3-64 of its data seeded with XXH3-64 of its kind, the
    seed of XXH3-64 of its payload as stored (the bytes in its row, or its side-file reference,
    whose sha256 checks the file), shifted into SQLite's signed 64-bit integers. Not
    cryptographic: it catches bytes changed by a bad disk, a torn copy or a hand edit, at a cost
    far below a write's."""
    return finish_row_hash(data_seed(kind, data), payload, None)


def stored_row_hash(kind: str, data: bytes, payload: bytes | None, ref: str | None) -> int:
    """`row_hash` of a row as its columns hold it: over its `payload_ref` when it has one."""
    return finish_row_hash(data_seed(kind, data), payload, ref)


def data_hash(kind: str, data: bytes) -> int:
    """`row_hash` of a row without a payload, in one step (the append's hot path)."""
    return _xxh3(data, _kind_seed(kind)) >> 1


def data_seed(kind: str, data: bytes) -> int:
    """The first half of `row_hash`, taken where the data is encoded (the append)."""
    return _xxh3(data, _kind_seed(kind))


@functools.cache
def _kind_seed(kind: str) -> int:
    return _xxh3(kind.encode())


def finish_row_hash(seed: int, payload: bytes | None, ref: str | None) -> int:
    """The second half of `row_hash`, taken once the payload's place is known (the commit): over
    the payload as stored, its bytes or, for a side file, its reference."""
    stored = payload if ref is None else ref.encode()
    return (seed if stored is None else _xxh3(stored, seed)) >> 1


_SQLITE_HEADER = b"SQLite format 3\x00"
_HEADER_LEN = 100

# Primary SQLite result codes (the low byte of an extended code).
_SQLITE_PERM, _SQLITE_READONLY, _SQLITE_CORRUPT = 3, 8, 11
_SQLITE_CANTOPEN, _SQLITE_NOTADB = 14, 26
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_IOERR, _SQLITE_FULL = 5, 6, 10, 13


def check_header(path: str) -> None:
    """Classify ``path`` from its first 100 bytes and its size, before SQLite touches it.

    Raises LogNotFoundError, NotSQLiteError or CorruptLogError (truncated).
    """
    try:
        with open(path, "rb") as f:
            header = f.read(_HEADER_LEN)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise LogNotFoundError(f"no event log at {path}") from None
    except IsADirectoryError:
        raise NotSQLiteError(f"{path} is a directory, not an SQLite event log") from None
    except PermissionError as e:
        raise LogError(f"cannot read {path}: {e.strerror}") from None
    if not header:  # CorruptLogError still: a run's events.db cut to nothing is a damaged log
        raise CorruptLogError(f"{path} is empty (0 bytes): a truncated log, or not an event log at all")
    if len(header) < _HEADER_LEN:
        if _SQLITE_HEADER.startswith(header[: len(_SQLITE_HEADER)]):
            raise CorruptLogError(f"{path} is truncated ({size} bytes, shorter than an SQLite header)")
        raise NotSQLiteError(f"{path} is not an SQLite database")
    if not header.startswith(_SQLITE_HEADER):
        raise NotSQLiteError(f"{path} is not an SQLite database")
    _check_size(path, header, size)


def _check_size(path: str, header: bytes, size: int) -> None:
    """Detect a file cut short: a partial last page, or fewer pages than the log holds.

    A page missing from the main file is not damage while the WAL holds it: a checkpoint that a
    full disk interrupted leaves the main file short (even by part of a page) and the WAL whole,
    and SQLite reads such a log whole. So the pages the log holds (the last commit in the WAL,
    else the header's count when SQLite marks it valid) must each be whole in the main file or
    in a WAL frame.
    """
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        raise CorruptLogError(f"{path} has a corrupted header (page size {page_size})")
    whole = size // page_size
    (n_pages,) = struct.unpack(">I", header[28:32])
    valid = n_pages and header[24:28] == header[92:96]
    wal_pages, wal_size = wal_frame_pages(path, page_size)
    # Without a commit in the WAL, a partial last page is the log's own: it must be whole.
    needed = wal_size or max(n_pages if valid else 0, whole + (1 if size % page_size else 0))
    missing = next((page for page in range(whole + 1, needed + 1) if page not in wal_pages), None)
    if missing is None:
        return
    if size % page_size:
        raise CorruptLogError(f"{path} is truncated ({size} bytes is not a whole number of pages)")
    raise CorruptLogError(f"{path} is truncated ({whole} of {needed} pages present)")


_WAL_HEADER = struct.Struct(">IIIIII")  # magic, version, page size, checkpoint seq, salt-1, salt-2
_WAL_FRAME_HEADER = struct.Struct(">IIII")  # page number, db size after commit (0: none), salts
_WAL_MAGICS = (0x377F0682, 0x377F0683)


def wal_has_frames(path: str) -> bool:
    """True if ``<path>-wal`` exists and holds at least one frame."""
    try:
        return os.path.getsize(path + "-wal") > 32  # 32-byte WAL header, then frames
    except OSError:
        return False


def wal_frame_pages(path: str, page_size: int) -> tuple[set[int], int]:
    """The pages that ``<path>-wal``'s current frames hold, and the log's size in pages after the
    last commit among them (0 if none): frames of the WAL's current generation only (their salts
    match its header), as SQLite reads it."""
    try:
        with open(path + "-wal", "rb") as f:
            header = f.read(32)
            if len(header) < 32:
                return set(), 0
            magic, _version, wal_page_size, _ckpt, salt1, salt2 = _WAL_HEADER.unpack(header[:24])
            if magic not in _WAL_MAGICS or wal_page_size != page_size:
                return set(), 0
            frames: list[int] = []  # each frame's page
            committed = size = 0  # the frames up to the last commit, and the log's size after it
            wal_bytes = os.fstat(f.fileno()).st_size
            for offset in range(32, wal_bytes - 24 - page_size + 1, 24 + page_size):  # whole frames
                f.seek(offset)
                page, db_size, frame_salt1, frame_salt2 = _WAL_FRAME_HEADER.unpack(f.read(_WAL_FRAME_HEADER.size))
                if (frame_salt1, frame_salt2) != (salt1, salt2):
                    break
                frames.append(page)
                if db_size:  # a commit: the frames up to here are the log
                    committed, size = len(frames), db_size
    except OSError:
        return set(), 0
    return set(frames[:committed]), size


def translate(exc: sqlite3.Error, path: str) -> LogError:
    """Map an sqlite3 error to the typed LogError it stands for (a plain LogError if none)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if code is not None else None
    msg = str(exc)
    # "decode to UTF-8": the driver's error for a text column that is not UTF-8
    if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in msg or "decode to UTF-8" in msg:
        return CorruptLogError(f"{path} is corrupted: {msg}")
    if primary in (_SQLITE_READONLY, _SQLITE_PERM):
        return ReadOnlyLocationError(f"cannot write {path}: {msg}")
    if primary == _SQLITE_CANTOPEN:
        return ReadOnlyLocationError(f"cannot open {path} (or its -wal/-shm files) for writing: {msg}")
    if primary == _SQLITE_FULL:
        return StorageError(f"cannot write {path}: the disk or quota is full ({msg})")
    if primary == _SQLITE_IOERR:
        return StorageError(f"I/O error on {path}: {msg}")
    if primary in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return StorageError(f"{path} is held by another connection past the busy timeout: {msg}")
    return LogError(f"{path}: {msg}")


def validate(conn: sqlite3.Connection, path: str) -> int:
    """Check that an open database is an orch log of a supported version; return that version.

    Raises ForeignDatabaseError, NewerFormatError or CorruptLogError.
    """
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        raise _as_log_error(e, path) from None
    if "meta" not in tables:
        raise ForeignDatabaseError(f"{path} is an SQLite database but not an orch event log (no meta table)")
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
    except sqlite3.DatabaseError as e:
        raise _as_log_error(e, path) from None
    if meta.get("magic") != MAGIC:
        raise ForeignDatabaseError(f"{path} is an SQLite database but not an orch event log (no orch magic)")
    version = check_version(meta.get("format_version"), path)
    missing = {"events", "snapshots"} - tables
    if missing:
        raise CorruptLogError(f"{path} lacks table(s) {', '.join(sorted(missing))}")
    return version


# At most this many of quick_check's problems are read: the first names the damage.
_DAMAGE_LINES = 8


def check_damage(conn: sqlite3.Connection, path: str) -> None:
    """Refuse a damaged database before a writer touches it: SQLite's ``PRAGMA quick_check``
    (every page and b-tree reachable and well formed; a linear scan of the file). A writer that
    appended onto a damaged file would spread the damage (docs/resume.md).

    Raises DamagedSnapshotsError when the events and meta tables check out and only the
    snapshots (a cache) are damaged, else CorruptLogError; both name the file and the first
    problem found.
    """
    problems = quick_check_problems(conn)
    if not problems:
        return
    more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
    where = f"{path} is damaged (SQLite's quick_check: {problems[0]}{more})"
    if not quick_check_problems(conn, "events") and not quick_check_problems(conn, "meta"):
        raise DamagedSnapshotsError(f"{where}; its events and meta tables are intact, its snapshots are not")
    raise CorruptLogError(where)


def quick_check_problems(conn: sqlite3.Connection, table: str | None = None) -> list[str]:
    """quick_check's problems (of one table and its indexes, or of the whole file), one per line."""
    arg = _DAMAGE_LINES if table is None else table
    try:
        rows = [row[0] for row in conn.execute(f"PRAGMA quick_check({arg})")]
    except sqlite3.DatabaseError as e:
        return [str(e)]
    lines = [line.strip() for row in rows for line in str(row).splitlines()]
    return [line for line in lines if line and line != "ok" and not line.startswith("***")]


def check_version(raw: str | None, path: str) -> int:
    """Parse meta.format_version; refuse a newer one."""
    try:
        version = int(raw)  # type: ignore[arg-type]  # None raises TypeError, reported below
    except (TypeError, ValueError):
        raise CorruptLogError(f"{path} has an invalid format_version {raw!r}") from None
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{path} uses log format version {version}; this orch reads up to {FORMAT_VERSION} (upgrade orch)"
        )
    if version < 1:
        raise CorruptLogError(f"{path} has an invalid format_version {raw!r}")
    if version < OLDEST_READ_VERSION:
        raise OlderFormatError(
            f"{path} uses log format version {version} (no payload column); this orch reads versions "
            f"{OLDEST_READ_VERSION}-{FORMAT_VERSION} only: read it with the orch that wrote it (docs/log-format.md)"
        )
    return version


def _as_log_error(exc: sqlite3.DatabaseError, path: str) -> LogError:
    """While checking a file: an error with no more specific type means the file is broken."""
    err = translate(exc, path)
    return err if type(err) is not LogError else CorruptLogError(f"{path}: {exc}")


def write_new_database(tmp: str, meta: dict[str, str], format_version: int = FORMAT_VERSION) -> None:
    """Create schema + meta in ``tmp`` in one transaction, then switch it to WAL. An older
    ``format_version`` (a rebuilt log keeps its own) marks columns it lacks as unused."""
    conn = sqlite3.connect(tmp, isolation_level=None)
    try:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # only before the first table
        conn.execute("BEGIN IMMEDIATE")
        for ddl in SCHEMA:
            conn.execute(ddl)
        rows = [("magic", MAGIC), ("format_version", str(format_version))]
        conn.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", rows + list(meta.items()))
        conn.execute("COMMIT")
        # WAL mode is persistent (recorded in the file header): set it once here.
        conn.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error as e:
        raise translate(e, tmp) from None
    finally:
        conn.close()  # last connection: SQLite checkpoints and removes tmp-wal/-shm


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

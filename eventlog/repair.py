"""Rebuilding a log whose only damage is in its snapshots table (docs/log-format.md: snapshots
are caches; a fold goes around a missing one).

A writer must not append onto a damaged file, and a damaged b-tree cannot be dropped in place
(SQLite walks it to free its pages). So the events and meta are copied, row for row (each event's
seq, ts, kind, data, payload, payload reference and checksum as they are), into a new file built like a new
log, which then replaces the damaged one; the damaged file is kept beside it, renamed, with its
-wal and -shm. Side files are the same files afterwards (their directory is named after the log's
path). Called by the writer's open, under the writer lock.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
from pathlib import Path

from . import fileformat
from .errors import CorruptLogError


def rebuild_without_snapshots(path: str) -> str:
    """Replace the log at `path` with a copy of its events and meta and no snapshot; return
    where the damaged file was moved. CorruptLogError if the copy is not whole."""
    stored = _meta(path)
    meta = {k: v for k, v in stored.items() if k not in fileformat.RESERVED_META_KEYS}
    version = fileformat.check_version(stored.get("format_version"), path)
    tmp = f"{path}.creating-{os.getpid()}"  # a leftover is removed by the next writer's open
    fileformat.write_new_database(tmp, meta, version)  # the one way a log file is built
    columns = "seq, ts, kind, data, payload, payload_ref" + (
        ", row_hash" if version >= fileformat.ROW_HASH_VERSION else ""
    )
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("ATTACH DATABASE ? AS damaged", (f"{Path(path).absolute().as_uri()}?mode=ro",))
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(f"INSERT INTO main.events({columns}) SELECT {columns} FROM damaged.events ORDER BY seq")
            copied, expected = (
                conn.execute(f"SELECT count(*) FROM {db}.events").fetchone()[0] for db in ("main", "damaged")
            )
            conn.execute("COMMIT")
            conn.execute("DETACH DATABASE damaged")
            if copied != expected or fileformat.quick_check_problems(conn):
                raise CorruptLogError(f"{path}: rebuilding it without its damaged snapshots failed")
        except sqlite3.DatabaseError as e:
            raise CorruptLogError(f"{path}: rebuilding it without its damaged snapshots failed: {e}") from None
        finally:
            conn.close()  # the last connection: the copy is checkpointed into tmp
        fileformat.fsync_path(tmp)
        aside = _free_name(path)
        os.link(path, aside)
        for suffix in ("-wal", "-shm"):
            if os.path.lexists(path + suffix):
                os.rename(path + suffix, aside + suffix)
        os.replace(tmp, path)
        fileformat.fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)
        return aside
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _meta(path: str) -> dict[str, str]:
    conn = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT key, value FROM meta"))
    finally:
        conn.close()


def _free_name(path: str) -> str:
    for n in itertools.count(1):
        aside = f"{path}.damaged-{n}"
        if not any(os.path.lexists(aside + suffix) for suffix in ("", "-wal", "-shm")):
            return aside
    raise AssertionError("unreachable")

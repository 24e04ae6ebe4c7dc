"""Typed errors of the event log.

Every error is a :class:`LogError` whose ``str()`` is one specific line, so a
command-line tool can print it and exit non-zero without a traceback.
"""

from __future__ import annotations

__all__ = [
    "LogError",
    "NotSQLiteError",
    "ForeignDatabaseError",
    "NewerFormatError",
    "OlderFormatError",
    "CorruptLogError",
    "DamagedSnapshotsError",
    "PayloadDroppedError",
    "WriterLockedError",
    "ReadOnlyLocationError",
    "StorageError",
    "SideFileLeftError",
    "LogNotFoundError",
    "LogExistsError",
    "InvalidEventError",
    "NotWriterError",
    "LogClosedError",
    "InvalidArgumentError",
]


class LogError(Exception):
    """Base class of every error raised by :mod:`eventlog`."""


class NotSQLiteError(LogError):
    """The path exists but is not an SQLite database file."""


class ForeignDatabaseError(LogError):
    """The path is an SQLite database, but not an orch event log."""


class NewerFormatError(LogError):
    """The log was written by a newer format version than this code supports."""


class OlderFormatError(LogError):
    """The log was written in an older format version, which this code does not read."""


class CorruptLogError(LogError):
    """The file is truncated or corrupted, fails its integrity check, or has a seq gap."""


class DamagedSnapshotsError(CorruptLogError):
    """Only the snapshots table (a cache of folded states) is damaged; the events are intact.
    A writer's open rebuilds the file without them (:mod:`eventlog.repair`)."""


class PayloadDroppedError(LogError):
    """The payload asked for was dropped (``EventLog.drop_payloads``): its row keeps the payload's
    sha256, not its bytes. Not damage: the row still verifies."""


class WriterLockedError(LogError):
    """Another writer (in this or another process) holds the log's writer lock."""

    def __init__(self, message: str, pid: int | None = None, host: str | None = None):
        super().__init__(message)
        self.pid = pid
        self.host = host


class ReadOnlyLocationError(LogError):
    """The log cannot be created or written at that location (permissions, read-only fs)."""


class StorageError(LogError):
    """The storage refused the operation: disk or quota full, an I/O error, or the database held
    by another connection past the busy timeout. A failed commit stored nothing."""


class SideFileLeftError(StorageError):
    """A side file no row references any more could not be deleted: disk used, nothing lost (the
    commit before it stands)."""


class LogNotFoundError(LogError):
    """No log at that path."""


class LogExistsError(LogError):
    """A log (or a leftover of one) already exists at that path."""


class InvalidEventError(LogError, ValueError):
    """An event cannot be stored: non-JSON value, NaN/Infinity, bad kind."""


class NotWriterError(LogError):
    """A write was attempted through a read-only handle (``EventLog.open_reader``)."""


class LogClosedError(LogError):
    """The handle was used after :meth:`EventLog.close`."""


class InvalidArgumentError(LogError, ValueError):
    """A bad argument: unknown durability, reserved meta key, snapshot past the end of the log."""

"""Is this an orch log, and of a format this orch reads: the one answer `orch run` (create and
resume) and `orch replay` give. An orch log's meta says `app = orch` and the `schema_version`
of its events (docs/log-format.md); a log without one predates the versioned format and is
refused, as one of another version is, in one line."""

from __future__ import annotations

import os

from eventlog import EventLog, LogError
from orchestrator.core.events import EVENT_SCHEMA_VERSION, check_schema_version
from orchestrator.notices import warn

APP = "orch"
LOG_MAGIC_META = {"app": APP, "schema_version": str(EVENT_SCHEMA_VERSION)}  # what `orch run` writes
# Said once by a resume or a replay command of a log written before row checksums (format 2),
# which it reads as that orch did (docs/log-format.md).
UNCHECKED_ROWS = "{db} was written before row checksums (log format 2): its rows are read unchecked"


def warn_if_unchecked(log: EventLog, db: str | os.PathLike) -> None:
    """Say once that `log` (at `db`) has no row checksums, if so."""
    if not log.row_hashes:
        warn(UNCHECKED_ROWS.format(db=db))


class OrchLogError(ValueError):
    """Not an orch log, or one of another format version; one-line message naming the file."""


def check_orch_meta(db: str | os.PathLike, meta: dict[str, str]) -> None:
    """OrchLogError unless `meta` (a log's meta table) is an orch log's of this format version."""
    if meta.get("app") != APP:
        raise OrchLogError(f"{db} is an event log, but not one written by orch (meta app={meta.get('app')!r})")
    try:
        check_schema_version(meta.get("schema_version", "(none)"))
    except ValueError as err:
        raise OrchLogError(f"{db}: {err}") from None


def open_orch_log(db: str | os.PathLike, *, pinned: bool = False) -> EventLog:
    """A read-only handle on the orch log `db`, its meta checked (`check_orch_meta`); `pinned`:
    at the last event committed now. LogError (missing, not SQLite, damaged) passes through."""
    log = EventLog.open_reader(db, pinned=pinned)
    try:
        check_orch_meta(db, log.meta)
    except (OrchLogError, LogError):
        log.close()
        raise
    return log

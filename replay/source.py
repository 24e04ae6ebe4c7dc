"""Opening a run's log for replay, and the typed error every replay command maps to exit 2.

`RUN` may be a run directory (holding `events.db`) or the database path itself. A log that is
missing, not SQLite, not an orch log, of a newer format or corrupted raises `ReplayInputError`
whose message is one line; the CLI prints it and exits 2.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import orjson

from eventlog import EventLog, LogError, PayloadDroppedError
from orchestrator.notices import one_line
from orchestrator.orch_log import OrchLogError, open_orch_log, warn_if_unchecked
from orchestrator.rundir import EVENTS_DB

REEXECUTED_META = "reexecuted"  # meta key marking a log written by `orch replay --reexecute`
# What a replay that reads a dropped payload adds to the log's line (docs/replay.md).
DROPPED_NOTE = (
    "this needs the token arrays, which the run dropped once trained on (log.token_arrays = until_trained); "
    "`orch replay --diff` compares them by the sha256 each row keeps"
)


class ReplayInputError(ValueError):
    """Bad input for a replay command (missing, foreign or corrupted log, bad option); one line."""


def row_data(seq: int, data: bytes | str, source: str | None = None):
    """A log row's data as JSON values; ReplayInputError (one line, naming `source`, the log,
    where two are read) if it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as err:
        where = f"{source}: " if source is not None else ""
        raise ReplayInputError(f"{where}seq {seq}: event data is not JSON ({err})") from None


def resolve_db(path: str | os.PathLike) -> Path:
    """The events.db of RUN (a run directory or the database file)."""
    p = Path(path)
    if p.is_dir():
        db = p / EVENTS_DB
        if not db.exists():
            raise ReplayInputError(f"{p} is a directory without an {EVENTS_DB}: not a run directory")
        return db
    if not p.exists():
        raise ReplayInputError(f"no run or event log at {p}")
    return p


def open_run(path: str | os.PathLike) -> EventLog:
    """A read-only handle on RUN's log, checked to be an orch log of this format
    (`orchestrator.orch_log`), pinned at the last event committed now: a run still writing it
    cannot make one command's reads disagree."""
    db = resolve_db(path)
    try:
        log = open_orch_log(db, pinned=True)
    except (LogError, OrchLogError) as err:
        raise ReplayInputError(one_line(str(err))) from None
    warn_if_unchecked(log, db)
    return log


def guarded(rows: Iterator, path: str) -> Iterator:
    """Re-raise a LogError met while streaming (corruption found mid-read) as ReplayInputError."""
    try:
        yield from rows
    except LogError as err:
        raise ReplayInputError(log_error_line(err)) from None


def log_error_line(err: LogError) -> str:
    """The one line a replay command prints for a LogError: a dropped payload's says why."""
    line = one_line(str(err))
    return f"{line}: {DROPPED_NOTE}" if isinstance(err, PayloadDroppedError) else line

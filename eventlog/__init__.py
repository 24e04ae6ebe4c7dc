"""eventlog: a generic, durable, append-only event log in one SQLite (WAL) file.

It knows nothing about RL: events are ``(seq, ts, kind, data)`` rows with JSON
``data``; state snapshots are opaque bytes keyed by a reducer version. ``Recorder`` is what a
run's loop and fold need of a log; EventLog and ``eventlog.memory.MemoryLog`` implement it.

    from eventlog import EventLog
    with EventLog.create("run/events.db", meta={"seed": "1"}) as log:
        seq = log.append("started", {"x": 1})
        log.commit()                      # one durable transaction per batch
    for rec in EventLog.open_reader("run/events.db").read():
        ...
"""

from . import errors
from .codec import canonical_json
from .errors import *  # noqa: F403 - the typed errors, listed in errors.__all__
from .fileformat import FORMAT_VERSION, MAGIC
from .log import EventLog, Record, Snapshot, VerifyReport
from .recorder import DroppedPayload, Recorder

__all__ = [
    "DroppedPayload",
    "EventLog",
    "Record",
    "Recorder",
    "Snapshot",
    "VerifyReport",
    "canonical_json",
    "FORMAT_VERSION",
    "MAGIC",
    *errors.__all__,
]

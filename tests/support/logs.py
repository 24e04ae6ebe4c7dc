"""A run's log: its invariants checked by SQL, its events read back, and simulated runs written as logs."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import orjson

from eventlog import EventLog
from eventlog.fileformat import stored_row_hash
from orchestrator.core import events as ev
from orchestrator.core.state import conservation
from orchestrator.fold import fold_log
from replay.logs import write_events
from tests.support.sim import SimOptions, SimWorld


def assert_log_invariants(run_dir: Path, max_steps: int, max_off_policy: int, target_lag: int) -> None:
    """A completed run: contiguous seqs, each step shipped once and in order within the lag rules,
    each batch file the one its event hashes, a `completed` stop, and nothing left behind."""
    db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)
    seqs = [row[0] for row in db.execute("SELECT seq FROM events ORDER BY seq")]
    assert seqs == list(range(1, len(seqs) + 1)), "contiguous seq"
    ships = db.execute(
        "SELECT seq, json_extract(data, '$.step'), json_extract(data, '$.sha256'), "
        "json_extract(data, '$.off_policy_max')"
        " FROM events WHERE kind = 'batch_shipped' ORDER BY seq"
    ).fetchall()
    assert [step for _, step, _, _ in ships] == list(range(1, max_steps + 1)), (
        "each step shipped exactly once, in order"
    )
    for seq, step, sha, lag_max in ships:
        assert lag_max <= max_off_policy
        (version,) = db.execute(
            "SELECT coalesce(max(json_extract(data, '$.version')), 0) FROM events"
            " WHERE kind = 'version_published' AND seq < ?",
            (seq,),
        ).fetchone()
        assert version >= step - 1 - target_lag, f"batch {step} shipped before version {step - 1 - target_lag}"
        path = run_dir / "batches" / f"step_{step}.safetensors"
        if batch_files_kept(db):
            assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        else:  # removed once the version trained on it was published: every step, by the run's end
            assert not path.exists(), f"{path} outlived the publication of the version trained on it"
    last_kind, reason = db.execute(
        "SELECT kind, json_extract(data, '$.reason') FROM events ORDER BY seq DESC LIMIT 1"
    ).fetchone()
    assert (last_kind, reason) == ("run_stopped", "completed")
    with EventLog.open_reader(run_dir / "events.db") as log:
        state = fold_log(log, use_snapshots=False).state
    holds, terms = conservation(state)
    assert holds, terms
    assert state.acct.completed_samples == terms["shipped"] + terms["dropped"]  # nothing left behind


def batch_files_kept(db: sqlite3.Connection) -> bool:
    """Does the run keep its batch files (log.batch_files = "keep", as it was created)?"""
    (config,) = db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
    return orjson.loads(config)["log"].get("batch_files") == "keep"


def count_events(run_dir: Path, kind: str, **fields: object) -> int:
    """How many `kind` events (with these field values, if given) a (possibly running, possibly not
    yet created) run's log has committed."""
    where = "".join(f" AND json_extract(data, '$.{name}') = ?" for name in fields)
    try:
        db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True, timeout=5)
        try:
            query = f"SELECT count(*) FROM events WHERE kind = ?{where}"
            return db.execute(query, (kind, *fields.values())).fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:  # no log yet, or its tables not yet created
        return 0


def shipped_batches(run_dir: Path) -> int:
    return count_events(run_dir, "batch_shipped")


def events(run_dir: Path, kind: str) -> list[tuple[int, dict]]:
    """(seq, fields) of a run's `kind` events; a trace's packed arrays decoded into lists."""
    with EventLog.open_reader(run_dir / "events.db") as log:
        found = list(log.read_rows(kinds=(kind,)))
    return [(seq, _fields(ev.decode_event(k, data, payload))) for seq, _ts, k, data, payload in found]


def _fields(event: ev.Event) -> dict:
    """Every field of an event (those at their defaults too) as JSON values; a trace's arrays as
    lists."""
    if isinstance(event, ev.EpisodeCompleted):
        fields = ev.with_arrays(event)
    else:
        fields = {name: getattr(event, name) for name in event.__struct_fields__}
    return orjson.loads(orjson.dumps(fields, default=lambda params: params.model_dump(mode="json")))


def decoded(path: Path) -> list[tuple[int, object]]:
    """Every event of a (small) log, decoded with its payload: (seq, event)."""
    with EventLog.open_reader(path) as log:
        return [(seq, ev.decode_event(kind, data, payload)) for seq, _ts, kind, data, payload in log.read_rows()]


def rows(path: Path) -> list[tuple[int, str, dict]]:
    """Every event of a (small) log: (seq, kind, data)."""
    with EventLog.open_reader(path) as log:
        return [(seq, kind, orjson.loads(data)) for seq, _ts, kind, data in log.read_raw()]


def sim_run(params: ev.CoreParams, seed: int, options: SimOptions | None = None) -> SimWorld:
    """A SimWorld run to its end."""
    world = SimWorld(params, seed=seed, options=options)
    world.run()
    return world


def sim_log(path: Path, params: ev.CoreParams, seed: int, options: SimOptions | None = None) -> Path:
    """Run a SimWorld and write its stream into an orch log at `path` (a .db file)."""
    world = sim_run(params, seed, options)
    write_events(path, world.log, meta={"seed": str(seed)})
    return path


def rewrite_row(db: Path | str, seq: int, data: bytes | str) -> None:
    """Give row `seq` new JSON `data` and its matching checksum: a row as other code would have
    written it (a recorded decision the current code makes differently), not damage."""
    data = data.encode() if isinstance(data, str) else data
    with sqlite3.connect(db) as conn:
        kind, payload, ref = conn.execute(
            "SELECT kind, payload, payload_ref FROM events WHERE seq = ?", (seq,)
        ).fetchone()
        check = stored_row_hash(kind, data, payload, ref)
        conn.execute("UPDATE events SET data = ?, row_hash = ? WHERE seq = ?", (data.decode(), check, seq))
    conn.close()

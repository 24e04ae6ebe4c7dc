"""Replay on a log a run is still writing, and on logs damaged in ways SQLite does not notice."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from eventlog import CorruptLogError, EventLog
from orchestrator.core import events as ev
from orchestrator.core.state import REDUCER_VERSION, state_hash
from orchestrator.fold import fold_log
from orchestrator.orch_log import APP
from replay.diff import diff_logs
from replay.logs import write_events
from replay.reexec import RecordedResults, ReexecOptions, reexecute
from replay.source import ReplayInputError, open_run
from tests.support.logs import sim_log, sim_run
from tests.support.params import sim_params


def _live_log(path, events, committed: int) -> EventLog:
    """A writer that has committed the first `committed` events and holds the rest unwritten."""
    log = EventLog.create(path, meta={"app": APP, "schema_version": str(ev.EVENT_SCHEMA_VERSION)})
    for event in events[:committed]:
        log.append_json(*ev.encode_event(event))
    log.commit()
    return log


def _commit_rest(writer: EventLog, events, committed: int) -> None:
    for event in events[committed:]:
        writer.append_json(*ev.encode_event(event))
    writer.commit()


@pytest.mark.parametrize("level", ["batches", "curriculum", "accounting", "events"])
def test_a_live_log_is_read_as_of_the_command_start(tmp_path, level):
    """Every read of one command stops where the log ended when it was opened: a diff of a live
    log with itself is equivalent, whatever the run commits while the diff reads."""
    events = sim_run(sim_params(0), 0).log
    half = len(events) // 2
    writer = _live_log(tmp_path / "live.db", events, half)
    with open_run(tmp_path / "live.db") as a, open_run(tmp_path / "live.db") as b:
        _commit_rest(writer, events, half)
        assert a.last_seq == b.last_seq == half
        assert len(list(a.read_raw())) == len(list(a.read_bodies())) == half
        assert fold_log(a).seq == half
        assert a.verify().ok and a.verify().last_seq == half
        assert diff_logs(a, b, level).equivalent
    with EventLog.open_reader(tmp_path / "live.db") as unpinned:
        assert unpinned.last_seq == len(events)
    writer.close()


def test_reexecuting_a_live_log_reexecutes_what_was_committed_when_it_started(tmp_path):
    events = sim_run(sim_params(2, finalize_in_background=True), 2).log
    cut = len(events) * 2 // 3
    writer = _live_log(tmp_path / "live.db", events, cut)
    with open_run(tmp_path / "live.db") as source:
        _commit_rest(writer, events, cut)  # the run goes on while the re-execution reads
        report = reexecute(source, tmp_path / "re", ReexecOptions("background", "recorded"))
        with open_run(report.out) as new:
            assert report.halted is None and diff_logs(source, new, "events").equivalent
    writer.close()
    write_events(tmp_path / "prefix.db", events[:cut])  # what was committed when it started
    with open_run(tmp_path / "prefix.db") as prefix:
        expected = reexecute(prefix, tmp_path / "re-prefix", ReexecOptions("background", "recorded"))
    ignore = {"source", "out"}
    assert {k: v for k, v in report.to_dict().items() if k not in ignore} == {
        k: v for k, v in expected.to_dict().items() if k not in ignore
    }


def _damage(path, sql: str, *params) -> None:
    with sqlite3.connect(path) as db:
        db.execute(sql, params)


def test_a_kind_that_is_not_utf8_is_a_corrupted_log_in_every_mode(tmp_path, cli):
    src = sim_log(tmp_path / "bad.db", sim_params(1), 1)
    _damage(src, "UPDATE events SET kind = CAST(X'657069736f6465ff' AS TEXT) WHERE seq = 100")
    for args in (
        [src, "--at", "200"],
        [src, "--check"],
        ["--diff", src, src, "--level", "events"],
        [src, "--reexecute", "--finalize", "background", "--out", tmp_path / "re"],
    ):
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.count("\n") == 1 and "is corrupted" in result.stderr and "UTF-8" in result.stderr


def test_a_missing_seq_is_a_corrupted_log_in_every_mode(tmp_path, cli):
    """Not a determinism failure (--check) nor a divergence (--reexecute, --diff)."""
    src = sim_log(tmp_path / "gap.db", sim_params(1), 1)
    _damage(src, "DELETE FROM events WHERE seq = 300")
    for args in (
        [src, "--check"],
        ["--diff", src, src, "--level", "accounting"],
        ["--diff", src, src, "--level", "events"],
        [src, "--reexecute", "--finalize", "background", "--out", tmp_path / "re"],
    ):
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.count("\n") == 1 and "not contiguous" in result.stderr
    with EventLog.open_reader(src) as log:  # a range that lies wholly in the gap
        with pytest.raises(CorruptLogError, match="seqs 300..300 are missing"):
            list(log.read(start=300, stop=300))
        with pytest.raises(CorruptLogError, match="seqs 299..300 are not contiguous"):
            list(log.read_raw(start=299, stop=301, chunk_size=2))


def test_event_data_that_is_not_json_is_named_by_read(tmp_path):
    src = sim_log(tmp_path / "bad.db", sim_params(1), 1)
    _damage(src, "UPDATE events SET data = '{not json' WHERE seq = 100")
    with EventLog.open_reader(src) as log, pytest.raises(Exception) as raised:
        list(log.read())
    assert type(raised.value).__name__ == "CorruptLogError" and "seq 100 is not JSON" in str(raised.value)


@pytest.mark.parametrize("state", [b"not json", b'{"garbage": 1}'])
def test_a_snapshot_whose_state_does_not_load_is_ignored(tmp_path, cli, state):
    """Its hash matches (written so), but this code cannot read it: a cache, folded around."""
    src = sim_log(tmp_path / "snap.db", sim_params(1), 1)
    with EventLog.open_reader(src) as log:
        expected = state_hash(fold_log(log).state)
        at = log.last_seq // 2
    _damage(
        src,
        "INSERT INTO snapshots(seq, reducer_version, state_hash, state) VALUES (?, ?, ?, ?)",
        at,
        REDUCER_VERSION,
        hashlib.sha256(state).hexdigest(),
        state,
    )
    with EventLog.open_reader(src) as log:
        assert log.load_snapshot(REDUCER_VERSION) is not None
        folded = fold_log(log)
    assert folded.from_snapshot is None and state_hash(folded.state) == expected
    assert cli(src).exit_code == 0


def test_reexecute_checks_the_recorded_finalize_results_against_their_checksums(tmp_path):
    """`--reexecute`'s pre-pass over the recorded results reads each row checked, as its other reads."""
    src = sim_log(tmp_path / "bad.db", sim_params(1), 1)
    with sqlite3.connect(src) as db:
        (seq,) = db.execute("SELECT min(seq) FROM events WHERE kind = 'group_finalized'").fetchone()
    _damage(src, "UPDATE events SET data = replace(data, '\"group_id\":', '\"group_id\": ') WHERE seq = ?", seq)
    with EventLog.open_reader(src) as log, pytest.raises(ReplayInputError, match=f"seq {seq}: its data or payload"):
        RecordedResults(log)

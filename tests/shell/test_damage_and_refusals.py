"""Damaged logs and refused commands (docs/resume.md "Damage and faults"): each is one line and
exit 2, before anything runs, and nothing is appended to the log."""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
from contextlib import closing
from pathlib import Path

import orjson
import pytest

from eventlog.fileformat import PAGE_SIZE as PAGE
from tests.support.cli import orch


def _fake_run(tmp_path: Path, steps: int = 5) -> Path:
    args = ("--env", "fake", "--trainer", "fake", "--max-steps", str(steps), "--runs-dir", str(tmp_path))
    done = orch("run", *args, "--name", "r", "--set", "log.batch_files=keep")  # a format-2 check reads them
    assert done.returncode == 0, done.stderr
    return tmp_path / "r"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: "), stderr
    return lines[0]


def test_resume_refuses_a_log_with_random_bytes_in_its_middle_and_appends_nothing(tmp_path):
    run = _fake_run(tmp_path)
    db = run / "events.db"
    pages = db.stat().st_size // PAGE
    with open(db, "r+b") as f:  # 4 KiB of noise at the start of a page in the middle of the file
        f.seek(pages // 2 * PAGE)
        f.write(random.Random(7).randbytes(4096))
    before = _digest(db)
    resumed = orch("run", "--resume", str(run), "--max-steps", "10")
    assert resumed.returncode == 2
    line = _one_error_line(resumed.stderr)
    assert f"{db} is damaged" in line and "quick_check" in line
    assert _digest(db) == before
    assert not os.path.exists(f"{db}-wal") or os.path.getsize(f"{db}-wal") == 0


def test_replay_and_resume_refuse_the_same_damage(tmp_path):
    run = _fake_run(tmp_path)
    db = run / "events.db"
    with open(db, "r+b") as f:
        f.seek(2 * PAGE)
        f.write(bytes(4096))  # the events table's root page
    before = _digest(db)
    assert orch("replay", str(run)).returncode == 2
    resumed = orch("run", "--resume", str(run), "--max-steps", "10")
    assert resumed.returncode == 2
    line = _one_error_line(resumed.stderr)
    assert f"{db} is corrupted" in line or f"{db} is damaged" in line
    assert _digest(db) == before


def test_resume_of_a_complete_run_is_one_line_and_appends_nothing(tmp_path):
    run = _fake_run(tmp_path, steps=3)
    db = run / "events.db"
    count = sqlite3.connect(db).execute("SELECT count(*) FROM events").fetchone()[0]
    resumed = orch("run", "--resume", str(run))
    assert resumed.returncode == 2
    assert _one_error_line(resumed.stderr) == (
        f"orch: error: {run} is complete at step 3; pass --max-steps 4 or more to continue it"
    )
    assert sqlite3.connect(db).execute("SELECT count(*) FROM events").fetchone()[0] == count
    assert orch("run", "--resume", str(run), "--max-steps", "4").returncode == 0


def test_an_unwritable_runs_dir_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = orch("run", "--runs-dir", str(tmp_path / "a_file" / "runs"), "--max-steps", "1")
    assert result.returncode == 2
    assert _one_error_line(result.stderr) == (
        f"orch: error: cannot write in the runs dir {tmp_path / 'a_file' / 'runs'}: Not a directory"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("replay", "RUN", "--episode", "abc"), "Invalid value for '--episode': 'abc' is not a valid integer"),
        (("run", "--progress-every", "0"), "Invalid value for '--progress-every': 0 is not in the range x>=1"),
        (("run", "--no-such-option"), "No such option '--no-such-option'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, says):
    result = orch(*args)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert says in line and line.endswith("--help`)")


def test_resume_asks_the_trainer_whether_what_it_kept_of_the_trained_steps_is_there(tmp_path, monkeypatch):
    from orchestrator.config import ConfigError
    from orchestrator.contracts import TrainerComponent
    from orchestrator.shell.runner import resume_run

    run = _fake_run(tmp_path, steps=2)
    asked = []

    def check_resume(self, run_dir, trained_steps):
        asked.append((run_dir, trained_steps))
        raise ConfigError("its checkpoint is gone")

    monkeypatch.setattr(TrainerComponent, "check_resume", check_resume)
    with pytest.raises(ConfigError, match="its checkpoint is gone"):
        resume_run(run, ["max_steps=3"])
    assert asked == [(run, 2)]


def _shipped_trace_row(db: Path) -> tuple[int, int]:
    """(seq, episode id) of the first trace batch 1 shipped, with a payload in the log's own column."""
    conn = sqlite3.connect(db)
    (trace_ids,) = conn.execute(
        "SELECT json_extract(data, '$.sample_ids') FROM events WHERE kind = 'batch_shipped'"
    ).fetchone()
    for trace_id in orjson.loads(trace_ids):
        row = conn.execute(
            "SELECT seq FROM events WHERE kind = 'episode_completed' AND json_extract(data, '$.episode_id') = ?"
            " AND length(payload) > 32",
            (trace_id,),
        ).fetchone()
        if row:
            return row[0], trace_id
    raise AssertionError("no shipped trace with an inline payload")


@pytest.mark.parametrize("log_format", [3, 2])
def test_check_names_a_damaged_payload_rather_than_blame_the_code(tmp_path, log_format):
    """By its row's checksum; in a log written before row checksums, by the batch file the run
    wrote (when it is there with the sha256 its batch_shipped recorded)."""
    run = _fake_run(tmp_path, steps=3)
    db = run / "events.db"
    seq, trace_id = _shipped_trace_row(db)
    with sqlite3.connect(db) as conn:  # 16 bytes of its token ids zeroed, as a bad disk would
        (payload,) = conn.execute("SELECT payload FROM events WHERE seq = ?", (seq,)).fetchone()
        conn.execute("UPDATE events SET payload = ? WHERE seq = ?", (bytes(16) + payload[16:], seq))
        if log_format == 2:
            conn.execute("ALTER TABLE events DROP COLUMN row_hash")
            conn.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    conn.close()
    checked = orch("replay", str(run), "--check")
    assert checked.returncode == 2
    if log_format == 3:
        line = _one_error_line(checked.stderr)
        assert (
            line
            == f"orch: error: {db} is damaged: seq {seq}: its data or payload fails its checksum "
            + (line.split("checksum ", 1)[1])
        )
        assert "(row_hash " in line
        return
    warning, line = checked.stderr.strip().splitlines()
    assert (
        warning == f"orch: warning: {db} was written before row checksums (log format 2): its rows are read unchecked"
    )
    assert line.startswith(f"orch: error: {db} is damaged: seq {seq} (the episode_completed of episode {trace_id}): ")
    assert "its token payload differs from what" in line and "not the code non-deterministic" in line
    (run / "batches" / "step_1.safetensors").unlink()  # nothing left to compare with: a divergence, as before
    assert orch("replay", str(run), "--check").returncode == 1


def test_a_run_whose_snapshots_are_damaged_replays_and_resumes_around_them(tmp_path):
    from tests.support.logs import assert_log_invariants

    args = ("--env", "fake", "--trainer", "fake", "--runs-dir", str(tmp_path), "--name", "r")
    assert orch("run", *args, "--max-steps", "8", "--set", "log.snapshot_every=200").returncode == 0
    run = tmp_path / "r"
    db = run / "events.db"
    (root,) = sqlite3.connect(db).execute("SELECT rootpage FROM sqlite_master WHERE name = 'snapshots'").fetchone()
    with open(db, "r+b") as f:
        f.seek((root - 1) * PAGE)
        f.write(b"\xa5" * 4096)
    assert orch("replay", str(run)).returncode == 0
    assert orch("replay", str(run), "--check").returncode == 0
    resumed = orch("run", "--resume", str(run), "--max-steps", "10")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{db}'s snapshots were damaged (its events are intact): rebuilt without them" in resumed.stderr
    assert (run / "events.db.damaged-1").exists()
    assert_log_invariants(run, 10, 2, 1)


def _crashed_before_ship(run: Path, ship: int) -> int:
    """Cut `run`'s log right before its `ship`-th batch_shipped, as a crash there would leave it
    (no snapshot, no later batch file): a batch of traces is queued. The seq it ends at."""
    conn = sqlite3.connect(run / "events.db")
    (cut,) = conn.execute(
        "SELECT seq - 1 FROM events WHERE kind = 'batch_shipped' ORDER BY seq LIMIT 1 OFFSET ?", (ship - 1,)
    ).fetchone()
    conn.execute("DELETE FROM events WHERE seq > ?", (cut,))
    conn.execute("DELETE FROM snapshots")  # caches: a snapshot would hold the traces whole
    conn.commit()
    conn.close()
    for batch in (run / "batches").glob("step_*.safetensors"):
        if int(batch.stem.removeprefix("step_")) >= ship:
            batch.unlink()
    return cut


def test_drop_damaged_drops_the_never_shipped_traces_whose_payloads_are_lost_and_continues(tmp_path):
    from eventlog import EventLog
    from orchestrator.fold import fold_log
    from tests.support.logs import assert_log_invariants, events, rows

    run = _fake_run(tmp_path, steps=5)
    cut = _crashed_before_ship(run, 2)
    db = run / "events.db"
    with EventLog.open_reader(db) as log:
        state = fold_log(log).state
    assert state is not None
    queued = next((t for t in state.pending if state.traces[t].n_tokens), None)
    members = [t for g in state.groups.values() for t in g.members if state.traces[t].n_tokens]
    lost = sorted({t for t in (queued, *members[:2]) if t is not None})
    assert lost, "held traces with tokens"
    with closing(sqlite3.connect(db)) as conn:  # their payloads cut short in their rows, as a torn copy would
        seqs = {
            t: conn.execute(
                "SELECT seq FROM events WHERE kind = 'episode_completed' AND json_extract(data, '$.episode_id') = ?",
                (t,),
            ).fetchone()[0]
            for t in lost
        }
        for seq in seqs.values():
            conn.execute("UPDATE events SET payload = substr(payload, 1, 10) WHERE seq = ?", (seq,))
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = _digest(db)

    refused = orch("run", "--resume", str(run))
    assert refused.returncode == 2
    line = _one_error_line(refused.stderr)
    assert f"seq {min(seqs.values())}" in line and f"orch run --resume {run} --drop-damaged" in line, line
    assert _digest(db) == before

    resumed = orch("run", "--resume", str(run), "--drop-damaged")
    assert resumed.returncode == 0, resumed.stderr
    assert f"dropping {len(lost)} trace" in resumed.stderr and "--drop-damaged" in resumed.stderr
    ((resume_seq, resume),) = events(run, "run_resumed")
    assert resume_seq == cut + 1 and resume["damaged_traces"] == lost
    # Dropped at once, as the resume's first decisions after the in-flight cancels.
    decided = [(kind, fields) for seq, kind, fields in rows(db) if seq > resume_seq][:200]
    dropped = [t for k, f in decided if k == "traces_dropped" and f["reason"] == "damaged" for t in f["trace_ids"]]
    cancelled = {f["group_id"] for kind, f in decided if kind == "group_cancelled" and f["reason"] == "damaged"}
    assert sorted(dropped) == [t for t in lost if state.traces[t].group_id not in cancelled]
    assert cancelled <= {g.group_id for g in state.groups.values() if g.finalizing}
    shipped = [t for _seq, fields in events(run, "batch_shipped") for t in fields["sample_ids"]]
    assert not set(lost) & set(shipped) and len(shipped) == len(set(shipped))
    ((_seq, started),) = events(run, "run_started")
    params = started["params"]
    assert_log_invariants(run, 5, params["max_off_policy_steps"], params["target_lag"])
    assert orch("replay", str(run)).returncode == 0
    # Nothing to drop any more: a later resume folds around them.
    again = orch("run", "--resume", str(run), "--max-steps", "6")
    assert again.returncode == 0, again.stderr


def test_drop_damaged_needs_a_resume(tmp_path):
    done = orch("run", "--env", "fake", "--trainer", "fake", "--runs-dir", str(tmp_path), "--drop-damaged")
    assert done.returncode == 2
    assert "--drop-damaged is for --resume" in _one_error_line(done.stderr)
    assert not any(tmp_path.iterdir())


def test_a_run_of_several_sample_episodes_shows_no_payload_damage_against_its_batch_files(tmp_path):
    """Each shipped sample is compared with its own part of its episode's payload."""
    from eventlog import EventLog
    from replay.damage import payload_damage

    args = ("--env", "fake", "--trainer", "fake", "--max-steps", "2", "--runs-dir", str(tmp_path), "--name", "r")
    result = orch("run", *args, "--set", "env.fake.samples_per_episode=2", "--set", "log.batch_files=keep")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "r"
    with EventLog.open_reader(run / "events.db") as log:
        shipped = [(r.seq, r.data) for r in log.read(kinds=("batch_shipped",))]
        assert shipped and any(s >= 10**12 for _, data in shipped for s in data["sample_ids"])
        assert [payload_damage(log, seq, data) for seq, data in shipped] == [None] * len(shipped)

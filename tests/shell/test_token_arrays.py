"""Token arrays dropped once no resume can need them (log.token_arrays, docs/resume.md "Token
arrays are dropped once trained on"): a run with until_trained leaves no arrays of an episode it
no longer holds, each row keeping their sha256; a resume still works (it re-writes the batches
not yet trained from the arrays it kept); a log whose held arrays are gone is refused in one line;
the replays that need dropped arrays refuse in one line, and `--diff` compares them by sha256."""

from __future__ import annotations

import shutil
import sqlite3

from eventlog import EventLog
from eventlog.fileformat import row_hash
from orchestrator.core.state import episodes_with_arrays
from orchestrator.fold import fold_log
from orchestrator.rundir import batch_path
from tests.support.cli import kill_once, orch, spawn_orch
from tests.support.logs import assert_log_invariants, count_events
from tests.support.runs import fake_run_args, sets

QUIET = sets("zero_output_batches=100000")
UNTIL_TRAINED = sets("log.token_arrays=until_trained")


def _payload_rows(run_dir) -> dict[str, int]:
    """How many episode rows hold their arrays, and how many keep only their sha256."""
    db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)
    try:
        held = db.execute(
            "SELECT count(*) FROM events WHERE kind = 'episode_completed' AND (payload IS NOT NULL"
            " OR (payload_ref IS NOT NULL AND payload_ref NOT LIKE 'dropped:%'))"
        ).fetchone()[0]
        dropped = db.execute("SELECT count(*) FROM events WHERE payload_ref LIKE 'dropped:%'").fetchone()[0]
    finally:
        db.close()
    return {"held": held, "dropped": dropped}


def _one_line_refusal(result, *phrases: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    for phrase in phrases:
        assert phrase in line, line


def _episode_seqs(run_dir, episodes: set[int]) -> list[int]:
    with EventLog.open_reader(run_dir / "events.db") as log:
        return [r.seq for r in log.read(kinds=("episode_completed",)) if r.data["episode_id"] in episodes]


def test_until_trained_leaves_no_arrays_of_a_finished_run_and_the_log_still_verifies(tmp_path):
    run = orch(*fake_run_args(tmp_path, "r", steps=8), *QUIET, *UNTIL_TRAINED)
    assert run.returncode == 0, run.stderr
    run_dir = tmp_path / "r"
    # At its end every batch is trained on and the drain dropped the traces still held: no resume
    # needs any array.
    rows = _payload_rows(run_dir)
    assert rows["held"] == 0 and rows["dropped"] > 0, rows
    with EventLog.open_reader(run_dir / "events.db") as log:
        assert log.verify().ok  # a dropped payload is not damage
    assert_log_invariants(run_dir, 8, max_off_policy=2, target_lag=1)


def test_a_keep_run_resumed_with_until_trained_drops_what_it_logged_before(tmp_path):
    run_dir = tmp_path / "r"
    assert orch(*fake_run_args(tmp_path, "r", steps=3), *QUIET).returncode == 0
    kept = _payload_rows(run_dir)
    assert kept["dropped"] == 0 and kept["held"] > 0  # keep, the default
    resumed = orch("run", "--resume", str(run_dir), "--max-steps", "5", *UNTIL_TRAINED)
    assert resumed.returncode == 0, resumed.stderr
    after = _payload_rows(run_dir)
    assert after["held"] == 0 and after["dropped"] > kept["held"], after


def test_a_killed_until_trained_run_resumes_rebuilding_its_untrained_batches_and_refuses_if_their_arrays_are_gone(
    tmp_path,
):
    """Killed while batches are shipped and not yet trained: their samples' arrays are kept, so a
    resume re-writes their files with the sha256 their `batch_shipped` logged (the files are
    deleted first to prove it). A copy whose held arrays were dropped by hand (what a retention
    that dropped what a resume needs would leave) is refused in one line, nothing appended."""
    run_dir = tmp_path / "r"
    keep_files = sets("log.batch_files=keep", "batch.size=16", "trainer.fake.step_time_s=0.5")
    proc = spawn_orch(*fake_run_args(tmp_path, "r", steps=12), *UNTIL_TRAINED, *keep_files, *QUIET)
    kill_once(proc, lambda: count_events(run_dir, "version_published") >= 2, 60, "two versions published")
    with EventLog.open_reader(run_dir / "events.db") as log:
        state = fold_log(log).state  # reads every array it holds: none of them was dropped
    assert _payload_rows(run_dir)["dropped"] > 0
    needed = _episode_seqs(run_dir, episodes_with_arrays(state))
    assert needed
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)

    for step in state.shipped_batches:
        batch_path(run_dir, step).unlink(missing_ok=True)
    resumed = orch("run", "--resume", str(run_dir), *UNTIL_TRAINED, *sets("trainer.fake.step_time_s=0.01"))
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(run_dir, 12, max_off_policy=2, target_lag=1)  # every batch file's sha256 too
    assert _payload_rows(run_dir)["held"] == 0

    with EventLog.open(copy / "events.db") as log:
        log.drop_payloads(needed[:1])
        last = log.last_seq
    refused = orch("run", "--resume", str(copy))
    _one_line_refusal(refused, f"seq {needed[0]}: its payload was dropped")
    with EventLog.open_reader(copy / "events.db") as log:
        assert log.last_seq == last


def test_replays_that_need_dropped_arrays_refuse_in_one_line_and_diff_compares_them_by_sha256(tmp_path):
    """The same history, its arrays kept (A) and dropped (B): --diff finds them equal by the
    sha256 B keeps; C, A with one trace's logprobs changed, differs from B at that row."""
    a = tmp_path / "a"
    assert orch(*fake_run_args(tmp_path, "a", steps=3), *QUIET, *sets("log.batch_files=keep")).returncode == 0
    b, c = tmp_path / "b", tmp_path / "c"
    shutil.copytree(a, b)
    shutil.copytree(a, c)
    with EventLog.open(b / "events.db") as log:
        rows = [(r.seq, r.data) for r in log.read(kinds=("episode_completed",)) if r.data.get("tokens", [0])[0]]
        assert log.drop_payloads(seq for seq, _data in rows) == [seq for seq, _data in rows]
    seq, data = rows[0]
    db = sqlite3.connect(c / "events.db")
    kind, text, payload = db.execute("SELECT kind, data, payload FROM events WHERE seq = ?", (seq,)).fetchone()
    n_tokens = data["tokens"][0]
    changed = payload[: 4 * n_tokens] + bytes([payload[4 * n_tokens] ^ 1]) + payload[4 * n_tokens + 1 :]
    db.execute(
        "UPDATE events SET payload = ?, row_hash = ? WHERE seq = ?",
        (changed, row_hash(kind, text.encode(), changed), seq),
    )
    db.commit()
    db.close()

    same = orch("replay", "--diff", str(a), str(b), "--level", "events", "--json")
    assert same.returncode == 0, (same.stdout, same.stderr)
    differs = orch("replay", "--diff", str(c), str(b), "--level", "events", "--json")
    assert differs.returncode == 1, (differs.stdout, differs.stderr)
    assert f'"seq":{seq}' in differs.stdout.replace(" ", "") and "payload_sha256" in differs.stdout

    episode = data["episode_id"]
    for args in (("--episode", str(episode)), ("--check",)):
        _one_line_refusal(orch("replay", str(b), *args), "its payload was dropped", "log.token_arrays")
    assert orch("replay", str(a), "--episode", str(episode)).returncode == 0

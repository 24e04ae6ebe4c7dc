"""`orch replay` on bad input: exit 2 with one line on stderr; exit codes 0/1 otherwise."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from eventlog import EventLog
from tests.support.logs import sim_log
from tests.support.params import sim_params


@pytest.fixture
def good(tmp_path):
    return sim_log(tmp_path / "good.db", sim_params(0), 0)


@pytest.fixture
def other(tmp_path):
    return sim_log(tmp_path / "other.db", sim_params(1), 1)


def assert_bad_input(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _bad_files(tmp_path, good):
    missing = tmp_path / "missing"
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a database\n" * 20)
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE t(x)")
    not_orch = tmp_path / "not_orch.db"
    with EventLog.create(not_orch, meta={"app": "something-else"}) as log:
        log.append("x", {})
    newer = tmp_path / "newer.db"
    shutil.copy(good, newer)
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'format_version'")
    older = tmp_path / "older.db"  # event format 3: no token_versions, read as this format's would not be
    shutil.copy(good, older)
    with sqlite3.connect(older) as db:
        db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    older_table = tmp_path / "older_table.db"  # table format 1: no payload column
    shutil.copy(good, older_table)
    with sqlite3.connect(older_table) as db:
        db.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    unversioned = tmp_path / "unversioned.db"  # no schema_version: refused, as `orch run --resume` does
    shutil.copy(good, unversioned)
    with sqlite3.connect(unversioned) as db:
        db.execute("DELETE FROM meta WHERE key = 'schema_version'")
    truncated = tmp_path / "truncated.db"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2 + 100])
    return {
        "missing": (missing, "no run or event log at"),
        "dir without events.db": (empty_dir, "without an events.db"),
        "not sqlite": (text, "not an SQLite database"),
        "foreign sqlite": (foreign, "not an orch event log"),
        "other app": (not_orch, "not one written by orch"),
        "newer format": (newer, "format version 99"),
        "older event format": (older, "an orch log of format version 3; this orch reads version 6 only"),
        "older table format": (older_table, "uses log format version 1 (no payload column)"),
        "no event format version": (
            unversioned,
            "an orch log of format version (none); this orch reads version 6 only",
        ),
        "truncated": (truncated, "truncated"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "dir without events.db",
        "not sqlite",
        "foreign sqlite",
        "other app",
        "newer format",
        "older event format",
        "older table format",
        "no event format version",
        "truncated",
    ],
)
def test_bad_logs_exit_2_with_one_line(tmp_path, good, cli, case):
    path, fragment = _bad_files(tmp_path, good)[case]
    assert_bad_input(cli(path), fragment)
    assert_bad_input(cli(path, "--check"), fragment)
    assert_bad_input(cli("--diff", good, path), fragment)
    assert_bad_input(cli("--diff", path, good), fragment)
    assert_bad_input(cli(path, "--reexecute", "--finalize", "inline", "--out", tmp_path / "new"), fragment)


def test_corruption_met_while_streaming_exits_2(tmp_path, good, cli):
    bad = tmp_path / "bad.db"
    shutil.copy(good, bad)
    with sqlite3.connect(bad) as db:
        (page_size,) = db.execute("PRAGMA page_size").fetchone()
        (pages,) = db.execute("PRAGMA page_count").fetchone()
    raw = bytearray(bad.read_bytes())
    for page in range(pages // 2, pages - 1):  # scribble over interior pages of the events table
        start = page * page_size
        raw[start : start + page_size] = b"\xa5" * page_size
    bad.write_bytes(bytes(raw))
    for args in ([bad], [bad, "--check"], ["--diff", good, bad, "--level", "events"]):
        assert_bad_input(cli(*args))


def test_an_undecodable_event_exits_2(tmp_path, good, cli):
    bad = tmp_path / "bad.db"
    shutil.copy(good, bad)
    with sqlite3.connect(bad) as db:
        db.execute("UPDATE events SET kind = 'no_such_kind' WHERE seq = 5")
    assert_bad_input(cli(bad), "seq 5", "no_such_kind")
    assert_bad_input(cli(bad, "--check"), "seq 5")


@pytest.mark.parametrize("kind", ["episode_completed", "episode_dispatched"])  # an input, a decision
def test_an_event_whose_data_is_not_json_exits_2_in_every_mode_that_reads_it(tmp_path, good, cli, kind):
    bad = tmp_path / "bad.db"
    shutil.copy(good, bad)
    with sqlite3.connect(bad) as db:
        (seq,) = db.execute("SELECT min(seq) FROM events WHERE kind = ? AND seq > 100", (kind,)).fetchone()
        db.execute("UPDATE events SET data = '{not json' WHERE seq = ?", (seq,))
    modes = [[bad], [bad, "--check"]]
    if kind == "episode_completed":  # re-execution reads the recorded inputs only
        modes.append([bad, "--reexecute", "--finalize", "inline", "--out", tmp_path / "new"])
    for args in modes:
        assert_bad_input(cli(*args), f"seq {seq}")
    for pair in ([bad, good], [good, bad]):  # a diff names the log that holds the row, damaged
        assert_bad_input(cli("--diff", *pair, "--level", "events"), f"{bad} is damaged: seq {seq}")
    assert not (tmp_path / "new" / "events.db").exists()  # a failed re-execution leaves no log


@pytest.mark.parametrize(
    "args,fragment",
    [
        ([], "missing RUN"),
        (["{good}", "--diff", "{good}", "{other}"], "do not give RUN"),
        (["{good}", "--check", "--reexecute"], "cannot be combined"),
        (["--diff", "{good}", "{other}", "--check"], "cannot be combined"),
        (["{good}", "--level", "events"], "--level applies"),
        (["--diff", "{good}", "{other}", "--at", "3"], "--at applies"),
        (["{good}", "--reexecute", "--out", "{tmp}/x"], "needs --finalize"),
        (["{good}", "--reexecute", "--finalize", "inline"], "needs --finalize"),
        (
            ["{good}", "--reexecute", "--finalize", "inline", "--settle-order", "shuffled", "--out", "{tmp}/x"],
            "background only",
        ),
        (["{good}", "--reexecute", "--finalize", "background", "--seed", "3", "--out", "{tmp}/x"], "shuffled only"),
        (["{good}", "--out", "{tmp}/x"], "--reexecute only"),
    ],
)
def test_bad_options_exit_2(tmp_path, good, other, cli, args, fragment):
    args = [a.format(good=good, other=other, tmp=tmp_path) for a in args]
    assert_bad_input(cli(*args), fragment)
    assert not (tmp_path / "x").exists()


def test_an_out_that_cannot_be_created_exits_2(tmp_path, good, cli):
    (tmp_path / "afile").write_text("")
    assert_bad_input(
        cli(good, "--reexecute", "--finalize", "inline", "--out", tmp_path / "afile" / "new"),
        "--out: cannot create",
        "Not a directory",
    )


def test_unknown_option_and_level_are_usage_errors(good, cli):
    assert cli(good, "--bogus").exit_code == 2
    assert cli("--diff", good, good, "--level", "nonsense").exit_code == 2


def test_exit_codes_0_and_1(good, other, cli):
    assert cli(good).exit_code == 0
    assert cli(good, "--check").exit_code == 0
    assert cli("--diff", good, good).exit_code == 0
    assert cli("--diff", good, other).exit_code == 1
    for level in ("batches", "accounting", "curriculum", "events"):
        code, out = cli.json("--diff", good, other, "--level", level)
        assert code == 1 and out["equivalent"] is False and out["level"] == level
        assert out["divergence"]["a"]["seq"] >= 1


def test_run_dir_is_accepted(tmp_path, good, cli):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(good, run / "events.db")
    assert cli("--diff", run, good, "--level", "events").exit_code == 0


def test_reexecuting_a_gar_run_inline_is_one_line_with_the_rules_own_words(tmp_path, cli):
    gar = sim_log(tmp_path / "gar.db", sim_params(0, algorithm="gar", finalize_in_background=True), 0)
    assert_bad_input(
        cli(gar, "--reexecute", "--finalize", "inline", "--out", tmp_path / "x"),
        "cannot re-execute with --finalize inline: algorithm 'gar' is not one the core scores inline (grpo): "
        "it must finalize in the background",
    )

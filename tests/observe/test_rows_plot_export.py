"""The rows every sink and `orch plot` get, the figure, and `orch export`, checked against the log by SQL."""

from __future__ import annotations

import sqlite3

import orjson
import pytest
from matplotlib.lines import Line2D

from eventlog import EventLog
from orchestrator.core import evolve as evolve_module
from orchestrator.core.evolve import FoldError
from orchestrator.observe.export import export_run
from orchestrator.observe.plot import PANELS, plot_runs, series
from orchestrator.observe.rows import log_rows
from tests.observe.util import STEPS, connect, sql_series
from tests.support.cli import orch
from tests.support.logs import rewrite_row, sim_log
from tests.support.logs import rows as log_rows_of
from tests.support.params import sim_params


def _close(a, b):
    return len(a) == len(b) and all(x == pytest.approx(y, rel=1e-9, abs=1e-12) for x, y in zip(a, b))


def test_the_rows_are_the_logs_figures(runs):
    with EventLog.open_reader(runs["a"] / "events.db") as log:
        got = series(log)
    want = sql_series(runs["a"])
    assert set(want) <= set(got)
    for name, (steps, values) in want.items():
        assert got[name][0] == steps, name
        assert _close(got[name][1], values), name
    assert got["reward/mean"][0] == list(range(1, STEPS + 1))
    assert max(want["queue/finalizing"][1]) > 0 and max(want["waste/pct"][1]) > 0  # the panels have something to show
    assert set(got) - set(want) == {"batch/samples", "batch/tokens", "version", "waste/dropped"}


def test_plot_draws_every_panel_with_the_logs_values(runs, tmp_path):
    data = []
    for label in ("a", "b"):
        with EventLog.open_reader(runs[label] / "events.db") as log:
            data.append((label, series(log)))
    out = tmp_path / "runs.png"
    fig = plot_runs(data, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == [title for title, _, _ in PANELS]
    expected = {label: sql_series(runs[label]) for label in ("a", "b")}
    for ax, (title, _, lines) in zip(axes, PANELS):
        drawn = {line.get_label(): line for line in ax.get_lines() if isinstance(line, Line2D)}
        for label in ("a", "b"):
            for name, _, what in lines:
                if name not in expected[label]:  # the fake trainer reports no loss or KL
                    assert f"{label}: {what}" not in drawn
                    continue
                line = drawn[f"{label}: {what}"]
                steps, values = expected[label][name]
                assert list(line.get_xdata()) == steps, (title, label)
                assert _close(list(line.get_ydata()), values), (title, label)
    assert "not in the log" in [t.get_text() for t in axes[-1].texts]  # mismatch KL: the fake trainer has none


def test_plot_command_writes_the_png_and_refuses_bad_input_in_one_line(runs, tmp_path):
    result = orch("plot", str(runs["a"]), str(runs["b"] / "events.db"), "--out", str(tmp_path / "p.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "p.png").stat().st_size > 10_000
    for args, message in (
        ([str(tmp_path / "nope")], f"orch: error: no run or event log at {tmp_path / 'nope'}"),
        (
            [str(runs["a"]), "--out", str(tmp_path / "no" / "p.png")],
            f"orch: error: --out {tmp_path / 'no' / 'p.png'}: no such directory {tmp_path / 'no'}",
        ),
    ):
        bad = orch("plot", *args)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [message]


def test_export_counts_and_sums_equal_the_log(runs, tmp_path):
    out = tmp_path / "a.db"
    result = orch("export", str(runs["a"]), str(out))
    assert result.returncode == 0, result.stderr
    log, x = connect(runs["a"]), sqlite3.connect(out)

    def one(db, sql, *args):
        return db.execute(sql, args).fetchone()[0]

    def events(kind, expr="count(*)"):
        return one(log, f"SELECT {expr} FROM events WHERE kind = ?", kind)

    assert one(x, "SELECT count(*) FROM episodes") == events("episode_dispatched")
    assert one(x, "SELECT count(*) FROM groups") == events("group_dispatched")
    assert one(x, "SELECT count(*) FROM batches") == events("batch_shipped") == STEPS
    assert one(x, "SELECT count(*) FROM versions") == events("version_published")
    shipped = events("batch_shipped", "sum(json_array_length(json_extract(data, '$.sample_ids')))")
    assert one(x, "SELECT count(*) FROM episodes WHERE fate = 'shipped'") == shipped
    assert one(x, "SELECT sum(samples) FROM batches") == shipped
    assert one(x, "SELECT sum(tokens) FROM batches") == events("batch_shipped", "sum(json_extract(data, '$.n_tokens'))")
    # a batch's n_tokens counts its samples' tokens, prompt and completion
    assert one(x, "SELECT sum(prompt_tokens + completion_tokens) FROM episodes WHERE fate = 'shipped'") == events(
        "batch_shipped", "sum(json_extract(data, '$.n_tokens'))"
    )
    # each batch's mean reward is the mean of its episodes' rewards
    for step, reward_mean in x.execute("SELECT step, reward_mean FROM batches"):
        assert one(x, "SELECT avg(reward) FROM episodes WHERE step = ?", step) == pytest.approx(reward_mean)
    # lag at ship: the batch's off-policy max and mean
    for step, lag_max, lag_mean in x.execute("SELECT step, off_policy_max, off_policy_mean FROM batches"):
        assert one(x, "SELECT max(lag) FROM episodes WHERE step = ?", step) == lag_max
        assert one(x, "SELECT avg(lag) FROM episodes WHERE step = ?", step) == pytest.approx(lag_mean)
    # every drop, by reason, is the log's
    with EventLog.open_reader(runs["a"] / "events.db") as reader:
        from orchestrator.fold import fold_log

        acct = fold_log(reader, use_snapshots=False).state.acct
    by_reason = dict(x.execute("SELECT reason, count(*) FROM episodes WHERE fate = 'dropped' GROUP BY reason"))
    assert by_reason == acct.dropped and acct.dropped.get("stale") and acct.dropped.get("failed")
    assert one(x, "SELECT count(*) FROM episodes WHERE fate = 'cancelled'") == events("episode_cancelled")
    late = one(
        log,
        "SELECT count(*) FROM events c WHERE c.kind = 'episode_completed'"
        " AND EXISTS (SELECT 1 FROM events x"
        " WHERE x.kind = 'episode_cancelled' AND x.seq < c.seq"
        " AND json_extract(x.data, '$.episode_id') = json_extract(c.data, '$.episode_id'))",
    )
    assert one(x, "SELECT sum(late) FROM episodes") == late > 0
    assert one(x, "SELECT count(*) FROM episodes WHERE completed_seq IS NOT NULL") == acct.completed
    assert one(x, "SELECT sum(ok = 0) FROM episodes") == acct.failures
    assert one(x, "SELECT sum(reward) FROM episodes WHERE completed_seq IS NOT NULL") == pytest.approx(
        one(
            log,
            "SELECT sum(json_extract(c.data, '$.reward')) FROM events c WHERE c.kind = 'episode_completed'"
            " AND NOT EXISTS (SELECT 1 FROM events x WHERE x.kind = 'episode_cancelled' AND x.seq < c.seq"
            " AND json_extract(x.data, '$.episode_id') = json_extract(c.data, '$.episode_id'))",
        )
    )
    cancelled = dict(
        log.execute(
            "SELECT json_extract(data, '$.reason'), count(*) FROM events WHERE kind = 'group_cancelled' GROUP BY 1"
        )
    )
    assert dict(x.execute("SELECT reason, count(*) FROM groups WHERE outcome = 'cancelled' GROUP BY 1")) == cancelled
    assert one(x, "SELECT count(*) FROM groups WHERE outcome = 'admitted'") == acct.groups_admitted
    # the trainer's metrics, a column each
    for version, data in log.execute(
        "SELECT json_extract(data, '$.version'), data FROM events WHERE kind = 'version_published'"
    ):
        metrics = orjson.loads(data)["metrics"]
        row = x.execute("SELECT samples, tokens, step_time_s FROM versions WHERE version = ?", (version,)).fetchone()
        assert row == (metrics["samples"], metrics["tokens"], metrics["step_time_s"])
    types = {name: kind for _, name, kind, *_ in x.execute("PRAGMA table_info(versions)")}
    assert (types["samples"], types["tokens"], types["step_time_s"]) == ("INTEGER", "INTEGER", "REAL")
    # types, indexes and full-text search on the error messages
    columns = {name: kind for _, name, kind, *_ in x.execute("PRAGMA table_info(episodes)")}
    assert (columns["reward"], columns["step"], columns["fate"]) == ("REAL", "INTEGER", "TEXT")
    indexes = {row[1] for row in x.execute("PRAGMA index_list(episodes)")}
    assert {"idx_episodes_group_id", "idx_episodes_fate_reason"} <= indexes
    failed = one(x, "SELECT count(*) FROM episodes WHERE error LIKE '%error_rate%'")
    assert failed == acct.failures > 0
    assert one(x, "SELECT count(*) FROM episodes_fts WHERE episodes_fts MATCH 'error_rate'") == failed


def test_export_refuses_to_overwrite_without_replace(runs, tmp_path):
    out = tmp_path / "a.db"
    out.write_text("mine")
    result = orch("export", str(runs["a"]), str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"orch: error: {out} exists; pass --replace to overwrite it"]
    assert out.read_text() == "mine"
    assert orch("export", str(runs["a"]), str(out), "--replace").returncode == 0
    assert sqlite3.connect(out).execute("SELECT count(*) FROM batches").fetchone()[0] == STEPS


def test_replay_shows_the_trainer_metrics(runs):
    result = orch("replay", str(runs["a"]), "--json")
    assert result.returncode == 0, result.stderr
    shown = orjson.loads(result.stdout)["trainer_metrics"]
    logged = {
        str(v): orjson.loads(d)["metrics"]
        for v, d in connect(runs["a"]).execute(
            "SELECT json_extract(data, '$.version'), data FROM events WHERE kind = 'version_published'"
        )
    }
    assert shown == logged and len(shown) == STEPS
    table = orch("replay", str(runs["a"]))
    assert "trainer metrics" in table.stdout and "step_time_s" in table.stdout


def test_the_docs_count_the_panels_orch_plot_draws():
    from pathlib import Path

    words = {9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "observe.md").read_text(encoding="utf-8")
    assert f"{words[len(PANELS)]} panels per step" in doc


@pytest.fixture
def small_log(tmp_path):
    return sim_log(tmp_path / "run.db", sim_params(0), 0)


def test_an_event_that_contradicts_the_run_is_named_by_the_rows_and_the_export(small_log, tmp_path):
    seq, data = next((seq, data) for seq, kind, data in log_rows_of(small_log) if kind == "episode_dispatched")
    rewrite_row(small_log, seq, orjson.dumps({**data, "group_id": 999}))
    with EventLog.open_reader(small_log) as log:
        with pytest.raises(FoldError, match=f"seq {seq}: cannot fold the 'episode_dispatched' event: group 999 is not"):
            list(log_rows(log))
        with pytest.raises(FoldError, match=f"seq {seq}: .* group 999 is not in the state"):
            export_run(log, tmp_path / "out.db")


@pytest.mark.parametrize("bug", [KeyError(7), AttributeError("no attribute 'x'"), TypeError("bad operand")])
def test_a_reducer_bug_reads_as_itself_in_the_rows_and_the_export(small_log, tmp_path, monkeypatch, bug):
    def broken_reducer(state, event):
        raise bug

    monkeypatch.setitem(evolve_module._REDUCERS, "batch_shipped", broken_reducer)
    with EventLog.open_reader(small_log) as log:
        with pytest.raises(type(bug)) as info:
            list(log_rows(log))
        assert not isinstance(info.value, FoldError) and info.traceback[-1].name == "broken_reducer"
        with pytest.raises(type(bug)) as info:
            export_run(log, tmp_path / "out.db")
        assert not isinstance(info.value, FoldError) and info.traceback[-1].name == "broken_reducer"

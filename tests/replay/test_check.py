"""`orch replay RUN --check`: re-derive every decision; catch injected non-determinism precisely."""

from __future__ import annotations

import itertools
import random
import sqlite3

import orjson
import pytest

from orchestrator.core import decide as decide_mod
from orchestrator.core import events as ev
from orchestrator.core.rng import choose_by_ratio
from replay.check import check_log
from replay.source import open_run
from tests.support.logs import rewrite_row, rows, sim_log
from tests.support.params import sim_params
from tests.support.sim import SimOptions


@pytest.mark.parametrize("background,settle", [(False, "immediate"), (True, "immediate"), (True, "random")])
@pytest.mark.parametrize("seed", [0, 5])
def test_recorded_runs_are_deterministic(tmp_path, seed, background, settle):
    path = sim_log(
        tmp_path / "a.db",
        sim_params(seed, finalize_in_background=background, max_off_policy_steps=1),
        seed,
        SimOptions(settle=settle),
    )
    with open_run(path) as log:
        result = check_log(log)
    assert result.deterministic, result.divergence
    events = rows(path)
    assert result.inputs + result.decisions == len(events)
    assert result.decisions == sum(1 for _, kind, _ in events if kind not in ev.INPUT_KINDS)
    # The role is the kind's: a background result is an input of its own kind, an inline one a decision.
    results = {kind for _, kind, _ in events if kind in ("group_finalized", "background_finalized")}
    assert results == ({"background_finalized"} if background else {"group_finalized"})


def test_cli_says_deterministic_with_the_count(tmp_path, cli):
    path = sim_log(tmp_path / "a.db", sim_params(1), 1)
    result = cli(path, "--check")
    assert result.exit_code == 0, result.output
    with open_run(path) as log:
        n = check_log(log).decisions
    assert result.stdout.startswith(f"deterministic: {n} decisions re-derived")


def test_unseeded_env_choice_is_caught_at_the_first_dispatch_it_changes(tmp_path, monkeypatch, cli):
    """A rule that draws the env from an unseeded RNG: recorded, then re-derived differently."""
    path = sim_log(tmp_path / "a.db", sim_params(2, env_ratios={"a": 1.0, "b": 1.0, "c": 1.0}), 2)
    recorded = [(seq, data) for seq, kind, data in rows(path) if kind == "group_dispatched"]
    draws = []
    unseeded = random.Random()  # the bug: no seed, not from the state

    def choose(ratios, u):
        env = choose_by_ratio(ratios, unseeded.random())
        draws.append(env)
        return env

    monkeypatch.setattr(decide_mod, "choose_by_ratio", choose)
    result = cli(path, "--check", "--json")
    assert result.exit_code == 1
    report = orjson.loads(result.stdout)
    # The first group whose drawn env differs from the recorded one is the reported divergence.
    first = next(i for i, env in enumerate(draws) if env != recorded[i][1]["env"])
    div = report["divergence"]
    assert div["a"]["seq"] == recorded[first][0] == div["b"]["seq"]
    assert div["a"]["kind"] == div["b"]["kind"] == "group_dispatched"
    assert div["a"]["data"] == recorded[first][1]
    # the env, and the task (each env has its own task cursor) when the two envs' cursors differ
    assert {f["path"] for f in div["fields"]} <= {"env", "task_id"}
    assert div["fields"][0] == {"path": "env", "a": recorded[first][1]["env"], "b": draws[first]}
    assert report["deterministic"] is False


def test_ids_from_a_process_global_counter_are_caught(tmp_path, monkeypatch):
    """Group ids from a module-level counter instead of the state: fine in the recording process,
    different the moment the decisions are re-derived."""
    counter = itertools.count(1)
    real = decide_mod.start_train_group

    def start_train_group(d):
        d.state.next_group_id = next(counter)  # the bug: an id that is not a function of the log
        return real(d)

    monkeypatch.setattr(decide_mod, "start_train_group", start_train_group)
    path = sim_log(tmp_path / "a.db", sim_params(3), 3)
    with open_run(path) as log:
        result = check_log(log)
    first_dispatch = next(seq for seq, kind, _ in rows(path) if kind == "group_dispatched")
    assert not result.deterministic
    div = result.divergence
    assert div.a.seq == first_dispatch and div.a.kind == "group_dispatched"
    assert [(f.path, f.a) for f in div.fields] == [("group_id", 1)]
    assert div.fields[0].b > 1


def test_a_tampered_decision_is_reported_at_its_seq(tmp_path):
    path = sim_log(tmp_path / "a.db", sim_params(4), 4)
    ships = [(seq, data) for seq, kind, data in rows(path) if kind == "batch_shipped"]
    seq, data = ships[3]
    rewrite_row(path, seq, orjson.dumps({**data, "sha256": "0" * 64}))  # as other code would record it
    with open_run(path) as log:
        result = check_log(log)
    assert not result.deterministic
    assert result.divergence.a.seq == seq
    assert [(f.path, f.a, f.b) for f in result.divergence.fields] == [("sha256", "0" * 64, data["sha256"])]


@pytest.mark.parametrize("kind, field", [("episode_completed", "reward"), ("batch_shipped", "reward_mean")])
def test_a_recorded_row_edited_is_named_as_damage_of_that_row_not_non_determinism(tmp_path, cli, kind, field):
    """An input's reward (or a decision's figure) changed in the data column: `--check` names the
    row as damage, exit 2, and never calls the code non-deterministic."""
    path = sim_log(tmp_path / "a.db", sim_params(4), 4)
    seq, data = next((seq, data) for seq, k, data in rows(path) if k == kind and data.get(field) is not None)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE events SET data = ? WHERE seq = ?", (orjson.dumps({**data, field: 0.123}).decode(), seq))
    db.close()
    result = cli(path, "--check")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("orch: error:") and result.stderr.count("\n") == 1
    assert f"is damaged: seq {seq}: its data or payload fails its checksum" in result.stderr
    assert "deterministic" not in result.output


def test_a_decision_the_code_no_longer_makes_is_reported(tmp_path, monkeypatch):
    path = sim_log(tmp_path / "a.db", sim_params(6), 6)
    events = rows(path)
    assert events[-1][1] == "run_stopped"
    monkeypatch.setattr(decide_mod, "finish_drain", lambda d: None)  # never stops
    with open_run(path) as log:
        result = check_log(log)
    div = result.divergence
    assert (div.a.seq, div.a.kind, div.b) == (events[-1][0], "run_stopped", None)
    assert result.decisions + result.inputs == len(events) - 1


def test_a_decision_the_code_now_adds_is_reported(tmp_path, monkeypatch):
    path = sim_log(tmp_path / "a.db", sim_params(6), 6)
    events = rows(path)
    real = decide_mod.finish_drain

    def finish_drain_twice(d):
        real(d)
        if d.state.stopped:
            d.emit(ev.RunStopped(reason="again"))

    monkeypatch.setattr(decide_mod, "finish_drain", finish_drain_twice)
    with open_run(path) as log:
        result = check_log(log)
    div = result.divergence
    assert div.a is None and (div.b.seq, div.b.kind, div.b.data["reason"]) == (
        events[-1][0] + 1,
        "run_stopped",
        "again",
    )
    assert "the log ends" in div.note


def test_the_current_code_raising_on_a_recorded_input_is_a_divergence(tmp_path, monkeypatch):
    path = sim_log(tmp_path / "a.db", sim_params(7), 7)

    def boom(d, e):
        raise RuntimeError("regression")

    monkeypatch.setitem(decide_mod._INPUT_RULES, "version_published", boom)
    first_publish = next(seq for seq, kind, _ in rows(path) if kind == "version_published")
    with open_run(path) as log:
        result = check_log(log)
    assert not result.deterministic
    assert result.divergence.a.seq == first_publish
    assert "RuntimeError: regression" in result.divergence.note


def test_logs_with_the_capacity_off_and_on_both_check_deterministic(tmp_path, cli):
    """Rule 1's dispatch capacity is re-derived as the log's run_started sets it."""
    old = sim_log(tmp_path / "old.db", sim_params(2, max_off_policy_steps=1), 2)
    assert all(data["params"]["capacity"] == "off" for _, kind, data in rows(old) if kind == "run_started")
    code, report = cli.json(old, "--check")
    assert code == 0 and report["deterministic"]
    new = sim_log(tmp_path / "new.db", sim_params(2, max_off_policy_steps=1, capacity="staleness"), 2)
    code, report = cli.json(new, "--check")
    assert code == 0 and report["deterministic"]
    # The two runs differ where the rule decides: the capacity closes the gate before max_inflight.
    assert any(kind == "gate_changed" and data["reason"] == "capacity" for _, kind, data in rows(new))

"""`orch replay RUN [--at SEQ] [--json]`: the folded state summary."""

from __future__ import annotations

import pytest

from orchestrator.core.events import decode_event
import orjson

from orchestrator.core.evolve import evolve, fold
from orchestrator.core.state import State, conservation, state_hash
from orchestrator.sim import SimOptions
from tests.replay.conftest import rows, sim_log, sim_params


@pytest.fixture
def bg_log(tmp_path):
    return sim_log(tmp_path / "bg.db", sim_params(3, finalize_in_background=True, max_off_policy_steps=1), 3,
                   SimOptions(settle="random", deliver_weight=0.05))


def _state_at(path, at):
    return fold(decode_event(kind, orjson.dumps(data)) for seq, kind, data in rows(path) if seq <= at)


def test_summary_at_a_seq_matches_an_independent_fold(bg_log, cli):
    # a point with queued traces, open groups and background-finalizing groups all present
    state = State()
    for at, kind, data in rows(bg_log):
        evolve(state, decode_event(kind, orjson.dumps(data)))
        groups = state.groups.values()
        if state.pending and any(g.finalizing for g in groups) and any(not g.finalizing for g in groups):
            break
    assert state == _state_at(bg_log, at)
    code, out = cli.json(bg_log, "--at", at)
    assert code == 0
    assert (out["seq"], out["step"], out["version"]) == (at, state.step, state.version)
    assert out["state_hash"] == state_hash(state)
    assert [(q["trace_id"], q["dispatch_version"], q["policy_start"]) for q in out["pending"]["items"]] == [
        (q.trace_id, q.dispatch_version, q.policy_start) for q in state.pending.values()]
    assert {g["group_id"]: g["members"] for g in out["open_groups"]} == {
        g.group_id: list(g.members) for g in state.groups.values() if not g.finalizing}
    assert {g["group_id"]: g["survivors"] for g in out["finalizing_groups"]} == {
        g.group_id: g.survivors for g in state.groups.values() if g.finalizing}
    assert all(g["background"] for g in out["finalizing_groups"])
    holds, terms = conservation(state)
    assert out["conservation"] == {"holds": holds, **terms} and holds
    assert out["accounting"]["completed"] == state.acct.completed


def test_summary_at_the_end_and_stable_json(bg_log, cli):
    first = cli(bg_log, "--json")
    second = cli(bg_log, "--json")
    assert first.exit_code == 0 and first.stdout == second.stdout
    code, out = cli.json(bg_log)
    assert out["seq"] == out["last_seq"] == len(rows(bg_log)) and out["stopped"] and out["stop_reason"] == "completed"
    assert list(out) == sorted(out), "sorted keys"


def test_human_summary(bg_log, cli):
    events = rows(bg_log)
    result = cli(bg_log, "--at", len(events) // 2)
    assert result.exit_code == 0, result.output
    for text in ("step (next batch)", "version", "conservation", "holds", "accounting", f"@ seq {len(events) // 2}/"):
        assert text in result.stdout


def test_summary_at_zero_and_out_of_range(bg_log, cli):
    code, out = cli.json(bg_log, "--at", 0)
    assert code == 0 and out["params"] is None and out["step"] == 1
    last = len(rows(bg_log))
    result = cli(bg_log, "--at", last + 1)
    assert result.exit_code == 2 and result.stderr == f"orch: error: --at {last + 1} is outside the log (seq 0..{last})\n"


def test_a_violated_conservation_exits_1(tmp_path, cli):
    import sqlite3

    import orjson

    path = sim_log(tmp_path / "a.db", sim_params(1), 1)
    seq, data = next((seq, data) for seq, kind, data in rows(path) if kind == "group_settled" and data["trace_ids"])
    data["trace_ids"].pop()  # a queued trace vanishes from the record, accounted nowhere
    with sqlite3.connect(path) as db:
        db.execute("UPDATE events SET data = ? WHERE seq = ?", (orjson.dumps(data).decode(), seq))
    code, out = cli.json(path, "--at", seq)
    assert code == 1 and out["conservation"]["holds"] is False
    assert cli.json(path, "--at", seq - 1) == (0, cli.json(path, "--at", seq - 1)[1])

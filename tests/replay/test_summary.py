"""`orch replay RUN [--at SEQ] [--json]`: the folded state summary."""

from __future__ import annotations

import orjson
import pytest

from orchestrator.core.evolve import evolve, fold
from orchestrator.core.state import conservation, initial_state, state_hash
from tests.support.logs import decoded, rewrite_row, rows, sim_log
from tests.support.params import sim_params
from tests.support.sim import SimOptions


@pytest.fixture
def bg_log(tmp_path):
    return sim_log(
        tmp_path / "bg.db",
        sim_params(3, finalize_in_background=True, max_off_policy_steps=1),
        3,
        SimOptions(settle="random", deliver_weight=0.05),
    )


def _state_at(path, at):
    return fold(event for seq, event in decoded(path) if seq <= at)


def test_summary_at_a_seq_matches_an_independent_fold(bg_log, cli):
    # a point with queued traces, open groups and background-finalizing groups all present
    events = decoded(bg_log)
    state = initial_state(events[0][1].params)
    for at, event in events:  # noqa: B007 - the event where the loop stops is reported below
        evolve(state, event)
        groups = state.groups.values()
        if state.pending and any(g.finalizing for g in groups) and any(not g.finalizing for g in groups):
            break
    assert state == _state_at(bg_log, at)
    code, out = cli.json(bg_log, "--at", at)
    assert code == 0
    assert (out["seq"], out["step"], out["version"]) == (at, state.step, state.version)
    assert out["state_hash"] == state_hash(state)
    assert [(q["sample_id"], q["dispatch_version"], q["policy_start"]) for q in out["pending"]["items"]] == [
        (q.sample_id, q.dispatch_version, q.policy_start) for q in state.pending.values()
    ]
    assert {g["group_id"]: g["members"] for g in out["open_groups"]} == {
        g.group_id: list(g.members) for g in state.groups.values() if not g.finalizing
    }
    assert {g["group_id"]: g["survivors"] for g in out["finalizing_groups"]} == {
        g.group_id: g.survivors for g in state.groups.values() if g.finalizing
    }
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


def test_summary_at_one_and_out_of_range(bg_log, cli):
    code, out = cli.json(bg_log, "--at", 1)
    assert code == 0 and out["params"]["seed"] == 3 and out["step"] == 1 and out["inflight_episodes"] == 0
    last = len(rows(bg_log))
    for at in (0, last + 1):  # before seq 1 there is no run, so no state to summarize
        result = cli(bg_log, "--at", at)
        assert result.exit_code == 2 and result.stderr == f"orch: error: --at {at} is outside the log (seq 1..{last})\n"


def test_a_violated_conservation_exits_1(tmp_path, cli):
    path = sim_log(tmp_path / "a.db", sim_params(1), 1)
    seq, data = next((seq, data) for seq, kind, data in rows(path) if kind == "group_settled" and data["sample_ids"])
    data["sample_ids"].pop()  # a queued trace vanishes from the record, accounted nowhere
    rewrite_row(path, seq, orjson.dumps(data))
    code, out = cli.json(path, "--at", seq)
    assert code == 1 and out["conservation"]["holds"] is False
    assert cli.json(path, "--at", seq - 1) == (0, cli.json(path, "--at", seq - 1)[1])


def test_the_trainer_metrics_table_fits_a_narrow_terminal_without_cutting_values(tmp_path):
    import io

    from rich.console import Console

    from replay.source import open_run
    from replay.summary import fold_run, render, summarize

    metrics = {"loss": 0.123456, "grad_norm": 12.3456, "entropy": 1.23456, "mismatch_kl": 0.000123456}
    metrics |= {"tokens": 123456, "learning_rate": 0.0005, "step_time_s": 0.0123456, "clipfrac": 0.0456}
    path = sim_log(tmp_path / "a.db", sim_params(3), 3)
    with open_run(path) as log:
        summary = summarize(fold_run(log, None), log)
    summary["trainer_metrics"] = {v: metrics for v in range(1, 6)}
    for width in (60, 80, 200):
        out = io.StringIO()
        render(summary, Console(file=out, width=width, highlight=False))
        text = out.getvalue()
        section = text[text.index("trainer metrics") : text.index("accounting")]
        assert "…" not in section, section
        assert max(len(line) for line in section.splitlines()) <= width
        for name in metrics:
            assert name in section
        for shown in ("0.1235", "12.35", "0.0001235", "123456"):
            assert shown in section
    assert section.count("trainer metrics") == 1  # wide enough: one table

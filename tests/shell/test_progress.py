"""Waste made visible: the progress line's waste share, the warning, the summary's tallies."""

from __future__ import annotations

import io

from rich.console import Console

from orchestrator.shell.progress import Progress
from tests.support.params import trainer_bound_params
from tests.support.sim import SimOptions, TimedSimWorld


def _trainer_bound_run(tmp_path, capacity: str) -> tuple[Progress, list[str], str, dict]:
    out, warnings = io.StringIO(), []
    progress = Progress(Console(file=out, width=400, highlight=False), warn=warnings.append)
    params = trainer_bound_params(1, max_steps=15, capacity=capacity)
    world = TimedSimWorld(params, seed=1, options=SimOptions(error_rate=0.0, empty_rate=0.0, reward_levels=20))
    feed = world.feed

    def feed_and_report(event):
        decisions = feed(event)
        for decision in decisions:
            if decision.kind == "batch_shipped":
                progress.on_batch(decision, world.state, None)
        return decisions

    world.feed = feed_and_report
    world.run()
    summary = progress.summary(world.state, tmp_path)
    return progress, warnings, out.getvalue(), summary


def test_an_over_provisioned_run_without_the_capacity_is_warned_about_naming_the_knobs(tmp_path):
    _, warnings, printed, summary = _trainer_bound_run(tmp_path, "off")
    assert warnings, "most of what it generated went stale"
    first = warnings[0]
    assert "completions shipped or dropped in the last 5 steps were dropped" in first
    assert all(20 < int(w.split("%")[0]) <= 100 for w in warnings), warnings
    for knob in ("rollout.max_inflight", "rollout.capacity", "off_policy.max_off_policy_steps"):
        assert knob in first
    # At most one warning per window of 5 steps over the 15 steps.
    assert len(warnings) <= 3
    lines = [line for line in printed.splitlines() if line.startswith("step")]
    assert len(lines) == 15 and all("| waste " in line for line in lines)
    acct = summary["dropped_by_reason"]
    assert summary["generated_episodes"] == summary["completed"] > summary["trained_episodes"] == summary["shipped"]
    assert sum(acct.values()) == summary["dropped"]
    wasted = sum(n for reason, n in acct.items() if reason not in ("drain", "stop"))  # not the run's end
    assert summary["waste_pct"] == round(100 * wasted / summary["completed"], 2) > 50
    assert summary["generated_tokens"] > summary["trained_tokens"] > 0
    assert "stale" in printed and "waste_pct" in printed


def test_the_same_run_with_the_capacity_is_not(tmp_path):
    _, warnings, printed, summary = _trainer_bound_run(tmp_path, "staleness")
    assert warnings == []
    assert summary["waste_pct"] < 5
    assert summary["trained_tokens"] <= summary["generated_tokens"]

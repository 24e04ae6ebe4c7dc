"""Background finalization in the real shell: errors, cap, drain, gauges."""

from __future__ import annotations

import sqlite3

from eventlog import EventLog
from orchestrator.core.events import decode_event
from orchestrator.core.evolve import evolve, fold
from orchestrator.core.state import conservation, initial_state
from tests.support.cli import orch
from tests.support.logs import assert_log_invariants
from tests.support.runs import fake_run_args, sets

GAR = [
    *fake_run_args(),
    *sets("algorithm.name=gar", "batch.size=16", "rollout.group_size=4", "rollout.max_inflight=32"),
]


def test_a_failing_grader_stops_the_run_with_its_error_and_logs_finalize_failed(tmp_path):
    result = orch(
        *GAR,
        "--max-steps",
        "50",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "r",
        "--set",
        "algorithm.gar.failure_rate=1.0",
        "--set",
        "algorithm.gar.delay_s=0.01",
        timeout=30,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("orch: error: background finalize of group") and "GraderError: grader failed" in last
    assert "Traceback" in result.stderr  # the original traceback, not swallowed
    db = sqlite3.connect(tmp_path / "r" / "events.db")
    assert db.execute("SELECT count(*) FROM events WHERE kind = 'finalize_failed'").fetchone()[0] >= 1


def test_finalizing_is_bounded_by_the_cap_plus_groups_in_flight_and_the_gate_says_why(tmp_path):
    cap, inflight, group_size = 2, 32, 4
    result = orch(
        *GAR,
        "--max-steps",
        "25",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "r",
        "--set",
        f"algorithm.max_finalizing_groups={cap}",
        "--set",
        "algorithm.gar.delay_s=0.03",
        "--set",
        "env.fake.latency_s=0.002",
    )
    assert result.returncode == 0, result.stderr
    assert_log_invariants(tmp_path / "r", 25, max_off_policy=2, target_lag=1)
    peak, cap_closures = 0, 0
    with EventLog.open_reader(tmp_path / "r" / "events.db") as log:
        events = [decode_event(*record[2:]) for record in log.read_rows()]
    state = initial_state(events[0].params)
    for event in events:
        evolve(state, event)
        peak = max(peak, sum(state.finalizing.values()))
        cap_closures += event.kind == "gate_changed" and event.reason == "finalizing_cap"
    assert cap_closures > 0
    groups_in_flight = inflight // group_size + 1  # a partly dispatched group counts too
    assert cap <= peak <= cap + groups_in_flight


def test_drain_cancels_finalizing_groups_without_waiting_for_their_grader(tmp_path):
    # graders of up to 4 s: cancelled at the drain, not awaited one after another (the bound);
    # no dispatch capacity, so groups beyond the last step are still finalizing at the drain
    result = orch(
        *GAR,
        "--max-steps",
        "3",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "r",
        "--set",
        "rollout.capacity=off",
        "--set",
        "algorithm.gar.delay_s=2.0",
        "--set",
        "algorithm.gar.jitter_s=1.99",
        "--set",
        "off_policy.max_off_policy_steps=8",
        "--set",
        "env.fake.latency_s=0.01",
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    db = sqlite3.connect(tmp_path / "r" / "events.db")
    drained = db.execute(
        "SELECT count(*) FROM events WHERE kind = 'group_cancelled' AND json_extract(data, '$.reason') = 'drain'"
    ).fetchone()[0]
    assert drained > 0
    # no drained group's grader result came back: the logged order shows they were cancelled
    late = db.execute(
        "SELECT count(*) FROM events f JOIN events c"
        " ON json_extract(f.data, '$.group_id') = json_extract(c.data, '$.group_id')"
        " WHERE f.kind = 'background_finalized' AND f.seq > c.seq"
        " AND c.kind = 'group_cancelled' AND json_extract(c.data, '$.reason') = 'drain'"
    ).fetchone()[0]
    assert late == 0
    with EventLog.open_reader(tmp_path / "r" / "events.db") as log:
        state = fold(decode_event(*record[2:]) for record in log.read_rows())
    assert not state.groups and not state.pending and conservation(state)[0]

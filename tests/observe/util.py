"""Helpers for the observe tests: real runs (fake env and trainer, 10 steps) to observe, and the
log's figures computed by SQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from eventlog import EventLog
from orchestrator.fold import fold_log
from orchestrator.observe.rows import THROUGHPUT_WINDOW, buffered_episodes
from tests.support.cli import orch
from tests.support.runs import fake_run_args, sets

STEPS = 10
# A run with something in every panel: background finalizing (gar), failed and empty episodes,
# stale drops and late completions (max_off_policy_steps 1 with a trainer slower than the env, and
# no dispatch capacity to keep generation to what can train).
BUSY = sets(
    "rollout.capacity=off",
    "algorithm.name=gar",
    "algorithm.gar.delay_s=0.002",
    "batch.size=32",
    "env.fake.error_rate=0.05",
    "env.fake.empty_rate=0.05",
    "env.fake.latency_s=0.001",
    "off_policy.max_off_policy_steps=1",
    "trainer.fake.step_time_s=0.02",
    "zero_output_batches=1000",
)


def run_fake(runs_dir: Path, name: str, *extra: str, steps: int = STEPS, env: dict | None = None) -> Path:
    result = orch(*fake_run_args(runs_dir, name, "--progress-every", "1000", *BUSY, *extra, steps=steps), env=env)
    assert result.returncode == 0, result.stderr
    return runs_dir / name


def connect(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)


DROPPED_SQL = """SELECT
  (SELECT coalesce(sum(json_array_length(d.value)), 0) FROM events, json_each(json_extract(data, '$.dropped')) d
    WHERE kind = 'group_settled' AND seq <= :seq)
  + (SELECT coalesce(sum(json_array_length(json_extract(data, '$.trace_ids'))), 0) FROM events
    WHERE kind = 'traces_dropped' AND seq <= :seq AND json_extract(data, '$.reason') NOT IN ('drain', 'stop'))
  + (SELECT coalesce(sum(json_extract(data, '$.count')), 0) FROM events WHERE kind = 'group_cancelled' AND seq <= :seq
    AND json_extract(data, '$.reason') NOT IN ('drain', 'stop'))
  + (SELECT coalesce(sum(json_array_length(json_extract(data, '$.pruned_ids'))), 0) FROM events
    WHERE kind = 'batch_shipped' AND seq <= :seq)"""
# Completions the run accepted: not those of an episode cancelled before it finished (late).
ACCEPTED_SQL = """SELECT count(*) FROM events c WHERE c.kind = 'episode_completed' AND c.seq <= :seq AND NOT EXISTS
  (SELECT 1 FROM events x WHERE x.kind = 'episode_cancelled' AND x.seq < c.seq
   AND json_extract(x.data, '$.episode_id') = json_extract(c.data, '$.episode_id'))"""
WINDOW_SQL = """SELECT count(*), coalesce(sum(json_extract(data, '$.tokens[1]')), 0)
  FROM events WHERE kind = 'episode_completed' AND seq > :since AND seq < :seq"""


def sql_series(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every plotted series, computed from events.db by SQL (buffered and finalizing: from the
    state folded at the ship's seq, which no SQL query gives)."""
    db = connect(run_dir)
    ships = db.execute(
        "SELECT seq, ts, json_extract(data, '$.step'), json_extract(data, '$.reward_mean'),"
        " json_extract(data, '$.off_policy_max'), json_extract(data, '$.off_policy_mean')"
        " FROM events WHERE kind = 'batch_shipped' ORDER BY seq"
    ).fetchall()
    start = db.execute("SELECT seq, ts FROM events WHERE kind = 'run_started'").fetchone()
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(name, step, value):
        steps, values = out.setdefault(name, ([], []))
        steps.append(step)
        values.append(value)

    marks = [start] + [(seq, ts) for seq, ts, *_ in ships]
    with EventLog.open_reader(run_dir / "events.db") as log:
        for k, (seq, ts, step, reward, lag_max, lag_mean) in enumerate(ships):
            add("reward/mean", step, reward)
            add("lag/max", step, lag_max)
            add("lag/mean", step, lag_mean)
            dropped = db.execute(DROPPED_SQL, {"seq": seq}).fetchone()[0]
            accepted = db.execute(ACCEPTED_SQL, {"seq": seq}).fetchone()[0]
            add("waste/pct", step, 100.0 * dropped / accepted)
            since_seq, since_ts = marks[max(0, k + 1 - THROUGHPUT_WINDOW)]
            episodes, tokens = db.execute(WINDOW_SQL, {"since": since_seq, "seq": seq}).fetchone()
            add("throughput/episodes_per_s", step, episodes / (ts - since_ts))
            add("throughput/tokens_per_s", step, tokens / (ts - since_ts))
            state = fold_log(log, at=seq, use_snapshots=False).state
            add("queue/buffered", step, buffered_episodes(state))
            add("queue/finalizing", step, sum(state.finalizing.values()))
    for version, name, value in db.execute(
        "SELECT json_extract(e.data, '$.version'), m.key, m.value FROM events e,"
        " json_each(json_extract(e.data, '$.metrics')) m WHERE e.kind = 'version_published' ORDER BY e.seq"
    ):
        add("trainer/" + name, version, value)
    return out

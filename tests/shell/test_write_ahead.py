"""Write-ahead: every effect happens only once the events that call for it are durable.

Checked from outside the writer: a second, read-only connection sees committed rows only."""

from __future__ import annotations

import sqlite3

from eventlog import EventLog
from orchestrator.config import load_config
from orchestrator.core import events as ev
from orchestrator.core.state import initial_state, state_hash
from orchestrator.fold import fold_log
from orchestrator.inference.fake import FakeEpisodes
from orchestrator.shell.compose import run_job
from orchestrator.shell.runner import OpenedRun
from orchestrator.trainers.fake import FakeTrainer


def test_effects_follow_the_commit_of_their_events(tmp_path, monkeypatch):
    config = load_config(
        None,
        [
            f"runs_dir={tmp_path}",
            "name=wa",
            'envs={"fake": 1.0}',
            "trainer.kind=fake",
            "max_steps=12",
            "batch.size=16",
            "rollout.max_inflight=48",
            "log.snapshot_every=50",
        ],
    )
    config.run_dir.mkdir(parents=True)
    log = EventLog.create(config.run_dir / "events.db", durability="full")
    db = sqlite3.connect(f"file:{config.run_dir / 'events.db'}?mode=ro", uri=True, check_same_thread=False)
    started, announced = [], []

    def committed(kind: str, field: str, value: int) -> bool:
        sql = f"SELECT count(*) FROM events WHERE kind = ? AND json_extract(data, '$.{field}') = ?"
        return db.execute(sql, (kind, value)).fetchone()[0] == 1

    fake_rollout, fake_announce = FakeEpisodes.__call__, FakeTrainer.batch_written

    async def rollout(self, req):
        started.append(committed("episode_dispatched", "episode_id", req.episode_id))
        return await fake_rollout(self, req)

    def batch_written(self, step, sha256):
        batch_file = config.run_dir / "batches" / f"step_{step}.safetensors"
        announced.append(committed("batch_shipped", "step", step) and batch_file.exists())
        fake_announce(self, step, sha256)

    monkeypatch.setattr(FakeEpisodes, "__call__", rollout)
    monkeypatch.setattr(FakeTrainer, "batch_written", batch_written)
    params = config.core_params()
    run = OpenedRun(config, config.run_dir, log, initial_state(params), ev.RunStarted(params=params), None)
    orch = run_job(run, None)
    log.close()
    assert orch.state.stop_reason == "completed"
    assert len(started) > 100 and all(started), "a rollout started before its dispatch was durable"
    assert len(announced) == 12 and all(announced), "the trainer heard of a batch before it was durable"
    # Each mid-run snapshot is the state as of its own seq, which a fold of the log rebuilds.
    snapshots = db.execute("SELECT seq, state_hash FROM snapshots ORDER BY seq").fetchall()
    assert len(snapshots) >= 3
    with EventLog.open_reader(config.run_dir / "events.db") as reader:
        for seq, snapshot_hash in snapshots:
            assert state_hash(fold_log(reader, at=seq, use_snapshots=False).state) == snapshot_hash, seq

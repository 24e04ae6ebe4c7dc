"""Batch files are removed once trained on (log.batch_files, docs/resume.md "Batch files are
removed once trained on"): the trainer checkpoints a step before it publishes it, so a published
version's batches are never read again; `keep` keeps them all."""

from __future__ import annotations

import hashlib
import sqlite3

from orchestrator.rundir import batch_path, batch_steps_on_disk
from tests.support.cli import orch
from tests.support.logs import assert_log_invariants
from tests.support.runs import fake_run_args, sets


def _shipped_sha256(run_dir) -> dict[int, str]:
    db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)
    rows = db.execute(
        "SELECT json_extract(data, '$.step'), json_extract(data, '$.sha256') FROM events WHERE kind = 'batch_shipped'"
    )
    return dict(rows.fetchall())


def test_a_run_removes_each_batch_file_once_the_version_trained_on_it_is_published(tmp_path):
    result = orch(*fake_run_args(tmp_path, "r", steps=12), *sets("zero_output_batches=100000"))
    assert result.returncode == 0, result.stderr
    assert batch_steps_on_disk(tmp_path / "r") == []  # every step trained on, every file gone
    assert_log_invariants(tmp_path / "r", 12, max_off_policy=2, target_lag=1)


def test_keep_keeps_every_batch_file_and_a_resume_with_until_trained_removes_the_trained_ones(tmp_path):
    run_dir = tmp_path / "r"
    kept = orch(*fake_run_args(tmp_path, "r", steps=6), *sets("log.batch_files=keep", "zero_output_batches=100000"))
    assert kept.returncode == 0, kept.stderr
    shipped = _shipped_sha256(run_dir)
    assert sorted(batch_steps_on_disk(run_dir)) == list(range(1, 7))
    for step, sha in shipped.items():
        assert hashlib.sha256(batch_path(run_dir, step).read_bytes()).hexdigest() == sha

    # The setting may change on resume: the six trained files left by the kept run are removed,
    # and so is each new one once trained on.
    resumed = orch("run", "--resume", str(run_dir), "--max-steps", "9", *sets("log.batch_files=until_trained"))
    assert resumed.returncode == 0, resumed.stderr
    assert batch_steps_on_disk(run_dir) == []
    assert sorted(_shipped_sha256(run_dir)) == list(range(1, 10))

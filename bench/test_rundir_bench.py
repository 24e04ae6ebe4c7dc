"""The run directory's bytes per trained token, per `log.batch_files` setting.

    .venv/bin/python -m pytest bench/test_rundir_bench.py -p no:randomly -o addopts= --benchmark-only -s

One fake run (fake env and trainer: long completions, nothing else slows it) per setting, in
turns, each to the same step; at its end the run directory is measured: the log (events.db, its
-wal and its payload side files), the batch files, everything. "Trained tokens" are those the
`batch_shipped` events shipped. The figure that grows with a run is the steady state: what stays
per trained token once the trainer has trained on it. Fails only if a setting does not do what it
says (until_trained leaves a trained batch file, keep loses one)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from orchestrator.rundir import batch_steps_on_disk, batches_dir
from tests.support.cli import orch
from tests.support.runs import fake_run_args, sets

STEPS = 40
SETTINGS = ("keep", "until_trained")
LONG_COMPLETIONS = sets(
    "env.fake.prompt_tokens=64",
    "env.fake.min_tokens=1000",
    "env.fake.max_tokens=4000",
    "batch.size=16",
    "zero_output_batches=100000",
)


def _bytes_under(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _trained_tokens(run_dir: Path) -> int:
    db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)
    try:
        query = "SELECT sum(json_extract(data, '$.n_tokens')) FROM events WHERE kind = 'batch_shipped'"
        return db.execute(query).fetchone()[0]
    finally:
        db.close()


def _measure(runs_dir: Path, setting: str) -> dict[str, float]:
    result = orch(
        *fake_run_args(runs_dir, setting, steps=STEPS), *LONG_COMPLETIONS, *sets(f"log.batch_files={setting}")
    )
    assert result.returncode == 0, result.stderr
    run_dir = runs_dir / setting
    kept = sorted(batch_steps_on_disk(run_dir))
    assert kept == (list(range(1, STEPS + 1)) if setting == "keep" else []), f"{setting} left batch files {kept}"
    tokens = _trained_tokens(run_dir)
    log = sum(_bytes_under(p) for p in run_dir.glob("events.db*"))
    batches, total = _bytes_under(batches_dir(run_dir)), _bytes_under(run_dir)
    return {
        "trained_tokens": tokens,
        "log_bytes_per_token": round(log / tokens, 2),
        "batch_bytes_per_token": round(batches / tokens, 2),
        "run_dir_bytes_per_token": round(total / tokens, 2),
    }


def test_run_directory_bytes_per_trained_token(benchmark, tmp_path):
    figures: dict[str, dict[str, float]] = {}

    def both() -> None:
        for setting in SETTINGS:
            figures[setting] = _measure(tmp_path, setting)

    benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update({setting: figures[setting] for setting in SETTINGS})
    for setting in SETTINGS:
        print(f"\n{setting}: {figures[setting]}")

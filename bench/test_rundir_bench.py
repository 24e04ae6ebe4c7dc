"""The run directory's bytes per trained token, per `log.batch_files` and `log.token_arrays`
setting.

    .venv/bin/python -m pytest bench/test_rundir_bench.py -p no:randomly -o addopts= --benchmark-only -s

One fake run (fake env and trainer: long completions, nothing else slows it) per setting, in
turns, each to the same step; at its end the run directory is measured: the log (events.db, its
-wal and its payload side files), the batch files, everything. "Trained tokens" are those the
`batch_shipped` events shipped. The figure that grows with a run is the steady state: what stays
per trained token once the trainer has trained on it, measured as what the run's second half (a
resume from STEPS / 2 to STEPS) added to the directory per token it trained. Fails only if a setting does not do what it
says (until_trained leaves a trained batch file or a trained trace's arrays, keep loses one).
Each setting is named `<batch_files>/<token_arrays>`; `log_share` is the log's part of the run
directory."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from orchestrator.rundir import batch_steps_on_disk, batches_dir
from tests.support.cli import orch
from tests.support.runs import fake_run_args, sets

STEPS = 200
# (log.batch_files, log.token_arrays)
SETTINGS = (("keep", "keep"), ("until_trained", "keep"), ("until_trained", "until_trained"))
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


def _held_arrays(run_dir: Path) -> int:
    """Episode rows whose arrays are still in the log (in their row or a side file)."""
    db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)
    try:
        query = (
            "SELECT count(*) FROM events WHERE kind = 'episode_completed' AND (payload IS NOT NULL"
            " OR (payload_ref IS NOT NULL AND payload_ref NOT LIKE 'dropped:%'))"
        )
        return db.execute(query).fetchone()[0]
    finally:
        db.close()


def _sizes(run_dir: Path) -> tuple[int, int, int, int]:
    """(trained tokens, log bytes, batch file bytes, run directory bytes)."""
    log = sum(_bytes_under(p) for p in run_dir.glob("events.db*"))
    return _trained_tokens(run_dir), log, _bytes_under(batches_dir(run_dir)), _bytes_under(run_dir)


def _measure(runs_dir: Path, batch_files: str, token_arrays: str) -> dict[str, float]:
    """Run to STEPS / 2, then resume to STEPS: the figures at the end, and the steady state, what
    the second half added per token it trained."""
    name = f"{batch_files}-{token_arrays}"
    settings = sets(f"log.batch_files={batch_files}", f"log.token_arrays={token_arrays}")
    result = orch(*fake_run_args(runs_dir, name, steps=STEPS // 2), *LONG_COMPLETIONS, *settings)
    assert result.returncode == 0, result.stderr
    run_dir = runs_dir / name
    half = _sizes(run_dir)
    result = orch("run", "--resume", str(run_dir), "--max-steps", str(STEPS), *settings)
    assert result.returncode == 0, result.stderr
    kept = sorted(batch_steps_on_disk(run_dir))
    assert kept == (list(range(1, STEPS + 1)) if batch_files == "keep" else []), f"{name} left batch files {kept}"
    held = _held_arrays(run_dir)
    assert (held == 0) == (token_arrays == "until_trained"), f"{name} left {held} episodes' arrays"
    tokens, log, batches, total = end = _sizes(run_dir)
    added = [b - a for a, b in zip(half, end, strict=True)]
    return {
        "trained_tokens": tokens,
        "log_bytes_per_token": round(log / tokens, 2),
        "batch_bytes_per_token": round(batches / tokens, 2),
        "run_dir_bytes_per_token": round(total / tokens, 2),
        "log_share": round(log / total, 3),
        "steady_log_bytes_per_token": round(added[1] / added[0], 2),
        "steady_run_dir_bytes_per_token": round(added[3] / added[0], 2),
    }


def test_run_directory_bytes_per_trained_token(benchmark, tmp_path):
    figures: dict[str, dict[str, float]] = {}

    def each() -> None:
        for batch_files, token_arrays in SETTINGS:
            figures[f"{batch_files}/{token_arrays}"] = _measure(tmp_path, batch_files, token_arrays)

    benchmark.pedantic(each, rounds=1, iterations=1)
    benchmark.extra_info.update(figures)
    for name, figure in figures.items():
        print(f"\n{name}: {figure}")

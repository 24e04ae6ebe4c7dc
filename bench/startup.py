"""`orch run`'s start-up and shutdown on the embedded job (the tiny HF model, the hf trainer),
paired: two checkouts of orch, alternated round by round (bench/paired.py), a warm-up of each
not counted (the first also builds the tiny model into the shared runs dir's cache).

    git worktree add /tmp/orch-base 01dc0e4         # the code to compare against
    .venv/bin/python bench/startup.py --baseline /tmp/orch-base --rounds 6

Each run is `python -m orchestrator.cli run --max-steps 3` (the default job, few steps) with
PYTHONPATH set to its checkout, in a fresh run dir. Per run: start-up (from the launch to the
run's first event, `run_started`, logged once the trainer published its warm start and the
sampler loaded it), shutdown (from its last event, `run_stopped`, to the process's exit) and
the total wall time. Printed as JSON: each side's medians, and the paired ratios candidate /
baseline (median, min, max, per round). A run that fails, or leaves a process naming its run
dir behind, stops the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import alternated_rounds, paired_ratio  # noqa: E402

FIGURES = ("startup_s", "shutdown_s", "wall_s")


def timed_run(checkout: Path, runs_dir: Path, name: str, steps: int) -> dict[str, float]:
    """One `orch run` of `checkout`'s code; its figures."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, "-m", "orchestrator.cli", "run", "--runs-dir", str(runs_dir), "--name", name]
    launched = time.time()
    done = subprocess.run(
        [*command, "--max-steps", str(steps)], cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: orch run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    run_dir = runs_dir / name
    left = processes_naming(run_dir)
    if left:
        raise SystemExit(f"{checkout}: processes left behind by {run_dir}: {left}")
    first, last = event_times(run_dir / "events.db")
    return {"startup_s": first - launched, "shutdown_s": exited - last, "wall_s": exited - launched}


def event_times(db: Path) -> tuple[float, float]:
    """The times of the log's first and last events."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT MIN(ts), MAX(ts) FROM events").fetchone()


def processes_naming(run_dir: Path) -> list[int]:
    """The processes whose command line names `run_dir` (a trainer left behind)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(run_dir).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="checkout of the code compared against")
    parser.add_argument("--candidate", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs-dir", type=Path, help="default: a temporary dir")
    args = parser.parse_args()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="orch-startup-"))
    sides = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}

    def side(name: str):
        async def one() -> float:
            figures = timed_run(sides[name], runs_dir, f"{name}-{len(results[name])}", args.steps)
            results[name].append(figures)
            print(name, {k: round(v, 2) for k, v in figures.items()}, file=sys.stderr, flush=True)
            return figures["wall_s"]

        return one

    asyncio.run(alternated_rounds(args.rounds, {name: side(name) for name in sides}))
    counted = {name: runs[1:] for name, runs in results.items()}  # the first of each: the warm-up
    report = {
        "rounds": args.rounds,
        "steps": args.steps,
        "medians": {
            name: {fig: round(statistics.median(r[fig] for r in runs), 2) for fig in FIGURES}
            for name, runs in counted.items()
        },
        "ratio_candidate_over_baseline": {
            fig: paired_ratio([r[fig] for r in counted["candidate"]], [r[fig] for r in counted["baseline"]])
            for fig in FIGURES
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""The loss options on a strongly off-policy embedded job (docs/hf.md "Loss"): a script, not a test.

Each variant runs the default embedded job (the tiny model, reverse_text, the hf trainer) made
off-policy: `off_policy.max_off_policy_steps=4`, `off_policy.target_lag=3`, and a trainer slowed
by `trainer.hf.min_step_time_s`, so that batches hold samples several versions old (the
measured mean lag is reported). The on-policy run (target lag 0, nothing older than the last
version) is beside them, with the same slow trainer. Per run: the mean reward of the last 5
steps and the held-out eval reward (docs/evals.md) at the last version.

    flock /tmp/orch-heavy.lock python bench/off_policy_losses.py --steps 16 --seeds 0 1 2

prints one markdown table (mean and min..max over seeds) and writes every run's figures to
--out (JSON). Runs share one runs dir, so the tiny model is built and warm-started once.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson

OFF_POLICY = ["off_policy.max_off_policy_steps=4", "off_policy.target_lag=3"]
ON_POLICY = ["off_policy.max_off_policy_steps=0", "off_policy.target_lag=0"]
VARIANTS: dict[str, list[str]] = {
    "on-policy (bypass)": ON_POLICY,
    "bypass (default)": OFF_POLICY,
    "tis": [*OFF_POLICY, "trainer.hf.loss.correction=tis"],
    "icepop": [*OFF_POLICY, "trainer.hf.loss.correction=icepop"],
    "decoupled": [*OFF_POLICY, "trainer.hf.loss.correction=decoupled"],
    "decoupled, 4 mini-batches": [
        *OFF_POLICY,
        "trainer.hf.loss.correction=decoupled",
        "trainer.hf.loss.mini_batches=4",
    ],
    "bypass, 4 mini-batches": [*OFF_POLICY, "trainer.hf.loss.mini_batches=4"],
    "gspo": [*OFF_POLICY, "trainer.hf.loss.ratio_level=sequence", "trainer.hf.loss.aggregation=seq-mean-token-mean"],
}


def run_one(runs_dir: Path, name: str, sets: list[str], seed: int, steps: int, delay: float, timeout: float) -> dict:
    common = [
        f"seed={seed}",
        f"max_steps={steps}",
        f"trainer.hf.min_step_time_s={delay}",
        'eval.envs=["reverse_text"]',
        f"eval.every={steps}",
    ]
    summary_path = runs_dir / f"{name}.summary.json"
    command = [sys.executable, "-m", "orchestrator.cli", "run", "--runs-dir", str(runs_dir), "--name", name]
    command += ["--json-summary", str(summary_path)]
    for item in [*common, *sets]:
        command += ["--set", item]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"{name}: orch run exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    summary = orjson.loads(summary_path.read_bytes())
    evals = [e for e in summary.get("evals", []) if e["version"] == max(x["version"] for x in summary["evals"])]
    return {
        "name": name,
        "reward_last5": summary["reward_last5"],
        "eval_reward": evals[0]["reward_mean"] if evals else None,
        "lag_mean": mean_lag(runs_dir / name),
        "wall_s": time.monotonic() - started,
    }


def mean_lag(run_dir: Path) -> float:
    """The batches' mean off-policy lag over the run (from its log's rows)."""
    from eventlog import EventLog
    from orchestrator.observe.rows import log_rows

    with EventLog.open_reader(run_dir / "events.db") as log:
        lags = [value for _, _, (_, name, value) in log_rows(log) if name == "lag/mean"]
    return sum(lags) / len(lags) if lags else 0.0


def spread(values: list[float]) -> str:
    return f"{sum(values) / len(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--delay", type=float, default=1.5, help="trainer.hf.min_step_time_s")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/off-policy-losses"))
    parser.add_argument("--out", type=Path, default=Path("runs/off-policy-losses.json"))
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on each run")
    args = parser.parse_args()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:  # seeds outermost: a cut-short bench still compares every variant
        for variant in args.variants:
            name = f"{re.sub('[^a-z0-9]+', '-', variant.lower()).strip('-')}-s{seed}-{int(time.time())}"
            row = run_one(args.runs_dir, name, VARIANTS[variant], seed, args.steps, args.delay, args.timeout)
            results.setdefault(variant, []).append(row | {"seed": seed})
            print(
                f"{variant} seed {seed}: last-5 reward {row['reward_last5']:.3f}, eval {row['eval_reward']}, "
                f"mean lag {row['lag_mean']:.2f}, {row['wall_s']:.0f}s",
                flush=True,
            )
            args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print("\n| variant | reward, last 5 steps | held-out eval reward (last version) | mean lag | seeds |")
    print("| --- | --- | --- | --- | --- |")
    for variant, rows in results.items():
        evals = [r["eval_reward"] for r in rows if r["eval_reward"] is not None]
        print(
            f"| {variant} | {spread([r['reward_last5'] for r in rows])} | {spread(evals) if evals else '-'} | "
            f"{spread([r['lag_mean'] for r in rows])} | {len(rows)} |"
        )


if __name__ == "__main__":
    main()

"""Several training samples per episode (docs/rules.md, "Samples"): the pipeline's throughput in
samples, one sample per episode against four, and what the log costs per token either way.

    .venv/bin/python -m pytest bench/test_samples_bench.py -p no:randomly -o addopts= --benchmark-only -s

`orch run`'s job (the SQLite log, durability full, the instant fake env, the fake trainer) with
`env.fake.samples_per_episode` 1 and 4, a warm-up of each not counted, then 6 rounds in
alternated order; the figure is the median of the per-round ratios of shipped samples/s (4 over
1), with its spread. `batch.size` counts samples, so both sides ship the same samples per step;
with 4 samples an episode, a step takes a quarter of the episodes. The log's bytes (file, WAL,
side files) per token completed are reported for each side. Fails only if a run does not complete
or its accounting does not hold (every completed sample shipped, dropped or pending).
"""

from __future__ import annotations

import statistics
import time

from bench.paired import order, paired_ratio
from bench.test_core_bench import _fake_config
from eventlog import EventLog
from orchestrator.core import events as ev
from orchestrator.core.state import conservation, initial_state
from orchestrator.shell.compose import run_job
from orchestrator.shell.runner import OpenedRun

STEPS, ROUNDS = 40, 6
SIDES = {"one": 1, "four": 4}


def run_side(tmp_path, name: str, samples: int) -> dict:
    config = _fake_config(tmp_path, name, STEPS, **{"env.fake.samples_per_episode": samples, "batch.cut": "groups"})
    config.run_dir.mkdir(parents=True)
    log = EventLog.create(config.run_dir / "events.db", durability="full")
    params = config.core_params()
    run = OpenedRun(config, config.run_dir, log, initial_state(params), ev.RunStarted(params=params), None)
    started = time.perf_counter()
    orch = run_job(run, None)
    elapsed = time.perf_counter() - started
    log.close()
    state = orch.state
    holds, terms = conservation(state)
    assert state.stop_reason == "completed" and holds, (state.stop_reason, terms)
    log_bytes = sum(p.stat().st_size for p in config.run_dir.rglob("events.db*") if p.is_file())
    return {
        "samples_per_s": terms["shipped"] / elapsed,
        "episodes_per_s": state.acct.completed / elapsed,
        "samples_per_episode": state.acct.completed_samples / state.acct.completed,
        "log_bytes_per_token": log_bytes / state.acct.completed_tokens,
    }


def test_pipeline_samples_per_second_one_vs_four_samples_an_episode(benchmark, tmp_path):
    figures: dict[str, list[dict]] = {side: [] for side in SIDES}
    rounds = iter(range(1 + ROUNDS))

    def one_round() -> None:
        r = next(rounds)
        for side in order(r, list(SIDES)):
            measured = run_side(tmp_path, f"{side}{r}", SIDES[side])
            if r:  # round 0 is the warm-up of each side
                figures[side].append(measured)

    benchmark.pedantic(one_round, rounds=1 + ROUNDS, iterations=1)

    def median(side: str, key: str) -> float:
        return statistics.median(f[key] for f in figures[side])

    ratio = paired_ratio([f["samples_per_s"] for f in figures["four"]], [f["samples_per_s"] for f in figures["one"]])
    summary = {side: {key: round(median(side, key), 2) for key in figures[side][0]} for side in SIDES} | {
        "four_over_one_samples_per_s": ratio
    }
    benchmark.extra_info.update(summary)
    print(f"\nsamples per episode 1 vs 4 ({STEPS} steps of 256 samples, {ROUNDS} rounds): {summary}")
    assert median("four", "samples_per_episode") == 4.0 and median("one", "samples_per_episode") == 1.0

"""The dispatch capacity (issue 22): the same run with `rollout.capacity` staleness and off.

    .venv/bin/python -m pytest bench/test_capacity_bench.py -o addopts= --benchmark-only -s

The real pipeline (fake env, fake trainer, SQLite log with full durability), each scenario run
once per setting, the two back to back, in alternating order from one scenario to the next:

* trainer-bound, the issue's scenario (1k-token prompts, 4k-16k-token completions, 512 episodes
  in flight, batches of 64, 0.5 s +- 0.4 s per episode, 0.5 s per trainer step), fewer steps;
* trainer-bound with short sequences (64-token prompts, 16-64-token completions);
* generation-bound: the issue's scenario with an instant trainer, and with short sequences.

Reported (extra_info and one line per scenario): episodes completed, samples shipped, stale
drops as a share of the completions, shipped samples/s and its ratio on/off. Targets: stale
<= 5% of the completions when trainer-bound, shipped samples/s >= 0.97 x off everywhere. The
figures are reported, not asserted; what is asserted is that both runs end and conserve their
accounting.
"""

from __future__ import annotations

import time

import pytest

from eventlog import EventLog
from orchestrator.config import load_config
from orchestrator.core import events as ev
from orchestrator.core.state import conservation, initial_state
from orchestrator.shell.compose import run_job
from orchestrator.shell.runner import OpenedRun

ISSUE_SCENARIO = {
    "env.fake.prompt_tokens": 1024,
    "env.fake.min_tokens": 4000,
    "env.fake.max_tokens": 16000,
    "rollout.max_inflight": 512,
    "batch.size": 64,
    "env.fake.latency_s": 0.5,
    "env.fake.latency_jitter_s": 0.4,
    "trainer.fake.step_time_s": 0.5,
}
SCENARIOS = {
    "trainer_bound": (12, ISSUE_SCENARIO),
    "trainer_bound_short": (
        16,
        {**ISSUE_SCENARIO, "env.fake.prompt_tokens": 64, "env.fake.min_tokens": 16, "env.fake.max_tokens": 64},
    ),
    "generation_bound": (12, {**ISSUE_SCENARIO, "trainer.fake.step_time_s": 0.0}),
    "generation_bound_short": (
        16,
        {
            **ISSUE_SCENARIO,
            "env.fake.prompt_tokens": 64,
            "env.fake.min_tokens": 16,
            "env.fake.max_tokens": 64,
            "trainer.fake.step_time_s": 0.0,
        },
    ),
}


def run_once(tmp_path, name: str, max_steps: int, sets: dict, capacity: str) -> dict:
    overrides = [
        f"name={name}-{capacity}",
        f"runs_dir={tmp_path}",
        'envs={"fake": 1.0}',
        "trainer.kind=fake",
        f"max_steps={max_steps}",
        "log.snapshot_every=0",
        "log.durability=full",
        f"rollout.capacity={capacity}",
        # Off, a short-sequence run with an instant trainer drops so many groups as stale
        # that the zero-output guard would stop it; both settings run to the end here.
        "zero_output_batches=1000",
    ]
    config = load_config(None, overrides + [f"{key}={value}" for key, value in sets.items()])
    config.run_dir.mkdir(parents=True)
    log = EventLog.create(config.run_dir / "events.db", durability="full")
    params = config.core_params()
    run = OpenedRun(config, config.run_dir, log, initial_state(params), ev.RunStarted(params=params), None)
    started = time.perf_counter()
    try:
        orch = run_job(run, None)
    finally:
        log.close()
    elapsed = time.perf_counter() - started
    state = orch.state
    assert state.stop_reason == "completed", (capacity, state.stop_reason, state.acct)
    holds, terms = conservation(state)
    assert holds, (capacity, terms)
    acct = state.acct
    return {
        "completed": acct.completed,
        "shipped": acct.shipped,
        "stale": acct.dropped.get("stale", 0),
        "stale_share": round(acct.dropped.get("stale", 0) / acct.completed, 4),
        "shipped_per_s": round(acct.shipped / elapsed, 1),
        "wall_s": round(elapsed, 2),
    }


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_capacity_on_vs_off(benchmark, tmp_path, scenario):
    max_steps, sets = SCENARIOS[scenario]
    order = ("staleness", "off") if list(SCENARIOS).index(scenario) % 2 == 0 else ("off", "staleness")
    results: dict[str, dict] = {}

    def both():
        for capacity in order:
            results[capacity] = run_once(tmp_path, scenario, max_steps, sets, capacity)

    benchmark.pedantic(both, rounds=1, iterations=1)
    on, off = results["staleness"], results["off"]
    ratio = on["shipped_per_s"] / off["shipped_per_s"]
    benchmark.extra_info.update(on=on, off=off, shipped_per_s_ratio=round(ratio, 3))
    print(
        f"\ncapacity {scenario}: on {on['completed']} completed, {on['shipped']} shipped, "
        f"stale {on['stale_share']:.1%}, {on['shipped_per_s']:,.0f} samples/s | off {off['completed']} completed, "
        f"{off['shipped']} shipped, stale {off['stale_share']:.1%}, {off['shipped_per_s']:,.0f} samples/s "
        f"| ratio {ratio:.2f}"
    )

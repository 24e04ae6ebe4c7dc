"""Weight updates during a long tail at speeds this machine does not have: the engine model of
bench/update_modes_sim.py, update_mode wait against interrupt.

    .venv/bin/python -m pytest bench/test_update_modes_sim_bench.py -o addopts= --benchmark-only -s

Two shapes: the long-tail bench's (16 tokens, one in 10 320 tokens, concurrency 32, a version
every second) at a GPU's decode speed, and an RL job at scale (1k tokens, one in 10 16k tokens,
concurrency 256, a version every minute). Each mode is simulated on ROUNDS seeds (the lengths
drawn differ); reported: tokens/s of each (medians), the paired ratio interrupt / wait per
seed (median and range), loads done and the time per load that no new request was admitted.
Asserted only what must hold: interrupt is never held by a drain (it loads at least as often as
wait), and both modes sample.
"""

from __future__ import annotations

import statistics

import pytest

from bench.paired import paired_ratio
from bench.update_modes_sim import Shape, simulate

ROUNDS = 6
SHAPES = {
    # the vLLM-CPU bench's lengths and publish rate, a 15 ms decode step, a 0.3 s reload
    "bench_shape_at_gpu_speed": Shape(
        step_s=0.015,
        per_request_s=0.00002,
        concurrency=32,
        prompt_tokens=5,
        short_tokens=16,
        long_tokens=320,
        long_every=10,
        publish_every_s=1.0,
        reload_s=0.3,
        prefill_tokens_per_s=50_000,
        duration_s=600,
    ),
    # reasoning-length answers, a version a minute, a 2 s reload, 100k prefill tokens/s
    "rl_at_scale": Shape(
        step_s=0.020,
        per_request_s=0.00005,
        concurrency=256,
        prompt_tokens=512,
        short_tokens=1024,
        long_tokens=16384,
        long_every=10,
        publish_every_s=60.0,
        reload_s=2.0,
        prefill_tokens_per_s=100_000,
        duration_s=1800,
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_simulated_tokens_per_s_wait_against_interrupt(benchmark, name):
    shape = SHAPES[name]

    def both():
        return {mode: [simulate(shape, mode, seed) for seed in range(ROUNDS)] for mode in ("wait", "interrupt")}

    outcomes = benchmark.pedantic(both, rounds=1, iterations=1)
    rates = {mode: [o.tokens_per_s for o in runs] for mode, runs in outcomes.items()}
    ratio = paired_ratio(rates["interrupt"], rates["wait"])
    for w, i in zip(outcomes["wait"], outcomes["interrupt"]):
        assert w.tokens > 0 and i.tokens > 0 and i.loads >= w.loads
    stalled = {m: round(statistics.median(o.stalled_per_load_s for o in runs), 2) for m, runs in outcomes.items()}
    loads = {m: statistics.median(o.loads for o in runs) for m, runs in outcomes.items()}
    benchmark.extra_info.update(
        shape=name,
        tokens_per_s={m: round(statistics.median(r), 1) for m, r in rates.items()},
        ratio=ratio,
        loads=loads,
        stalled_per_load_s=stalled,
    )
    print(
        f"\n{name}: interrupt {statistics.median(rates['interrupt']):.0f} tokens/s, wait "
        f"{statistics.median(rates['wait']):.0f} (medians of {ROUNDS} seeds): ratio {ratio['median']:.3f} "
        f"(range {ratio['min']:.3f}-{ratio['max']:.3f}); loads {loads}; no admission per load {stalled} s"
    )

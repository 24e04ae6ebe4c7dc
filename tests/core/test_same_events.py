"""Behaviour stays the same: a fixed matrix of simulated runs logs the same events, in the
same order, with the same fields, as the code did when the digests below were computed.

Each run's digest is the sha256 over its events' rows as the log stores them, each as `kind`, a
NUL, its data, a NUL, its payload and a newline: they pin today's format byte for byte
(docs/log-format.md). Regenerate (only for an intended change of behaviour or of the format,
saying so in the commit):

    PYTHONPATH=$PWD .venv/bin/python -m tests.core.test_same_events --regenerate
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from pathlib import Path

import orjson
import pytest

from orchestrator.core import events as ev
from tests.support.sim import SimOptions, SimWorld

DIGESTS = Path(__file__).with_name("same_events_digests.json")

# The matrix runs with the dispatch capacity off: its runs are the rules without it.
CAPACITY = "off"

SEEDS = range(6)
FINALIZE = {"inline": {}, "background": {"finalize_in_background": True}}
BATCHING = {"trace": {}, "token": {"token_batch_size": 120}}
MAX_OFF_POLICY_STEPS = (1, 2, 8)
MATRIX = list(itertools.product(SEEDS, FINALIZE, BATCHING, MAX_OFF_POLICY_STEPS))


def run_id(seed: int, finalize: str, batching: str, max_off: int) -> str:
    return f"s{seed}-{finalize}-{batching}-off{max_off}"


def simulate(seed: int, finalize: str, batching: str, max_off: int) -> list:
    params = ev.CoreParams(
        seed=seed,
        env_ratios={"a": 1.0, "b": 1.5},
        group_size=4,
        batch_size=16,
        max_inflight=24,
        max_steps=10,
        max_off_policy_steps=max_off,
        zero_output_batches=1000,
        **FINALIZE[finalize],
        **BATCHING[batching],
        capacity=CAPACITY,
    )
    # Background results held and delivered in a seeded random order, interleaved with completions.
    options = SimOptions(settle="random") if finalize == "background" else None
    world = SimWorld(params, seed=seed, options=options)
    world.run()
    return world.log


def digest(events: list) -> str:
    h = hashlib.sha256()
    for event in events:
        kind, data, payload = ev.encode_event(event)
        h.update(kind.encode() + b"\0" + data + b"\0" + (payload or b"") + b"\n")
    return h.hexdigest()


@pytest.mark.parametrize("seed,finalize,batching,max_off", MATRIX, ids=[run_id(*m) for m in MATRIX])
def test_the_run_logs_the_same_events(seed, finalize, batching, max_off):
    expected = orjson.loads(DIGESTS.read_bytes())[run_id(seed, finalize, batching, max_off)]
    assert digest(simulate(seed, finalize, batching, max_off)) == expected


def test_the_matrix_covers_both_finalize_paths_and_every_step():
    """The digests pin runs that really differ: background results arrive as inputs, and each run
    ships all its steps."""
    log = simulate(0, "background", "trace", 2)
    assert sum(e.kind == "batch_shipped" for e in log) == 10
    started = [e for e in log if e.kind == "finalize_started"]
    assert started and all(e.background for e in started)
    assert len(set(orjson.loads(DIGESTS.read_bytes()).values())) == len(MATRIX)


def regenerate() -> None:
    digests = {run_id(*m): digest(simulate(*m)) for m in MATRIX}
    DIGESTS.write_bytes(orjson.dumps(digests, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"wrote {len(digests)} digests to {DIGESTS}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python -m tests.core.test_same_events --regenerate")
    regenerate()

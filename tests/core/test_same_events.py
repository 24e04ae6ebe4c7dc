"""Behaviour stays the same: a fixed matrix of simulated runs logs the same events, in the
same order, with the same fields, as the code did when the digests below were computed.

Each run's digest is the sha256 over its events, each as `kind`, a NUL, its data as canonical JSON
(sorted keys) and a newline, after `as_recorded` maps the event back to the format the digests were
computed on (docs/log-format.md, "Version history"). Regenerate (only for an intended change of
behaviour, saying so in the commit):

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
from orchestrator.core.arrays import unpack
from tests.support.sim import SimOptions, SimWorld

DIGESTS = Path(__file__).with_name("same_events_digests.json")

# Core params pinned for every run of the matrix, in this one place: a param added after the
# digests were computed goes here with the value that keeps the old behaviour (and is left out of
# the digested `run_started`, which did not have it).
PINNED: dict[str, object] = {"capacity": "off"}  # the dispatch capacity (its "off" is the code before it)

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
        **PINNED,
    )
    # Background results held and delivered in a seeded random order, interleaved with completions.
    options = SimOptions(settle="random") if finalize == "background" else None
    world = SimWorld(params, seed=seed, options=options)
    world.run()
    return world.log


def as_recorded(kind: str, data: dict, payload: bytes | None) -> tuple[str, dict]:
    """An event of today's format as the digested format (version 1) wrote it, with the two
    values that a packed format cannot carry bit for bit mapped to what it does carry: each
    logprob as its float32 value, and no `batch_shipped.sha256` (the hash of a batch file,
    whose format is not the log's; the batch's content is the digested traces, advantages and
    trace ids). Since version 3 a trace's arrays are its payload: they go back into its fields as
    lists, in place of `n_tokens` and `sampled_tokens`."""
    if kind == "episode_completed":
        token_ids, mask, logprobs = unpack(payload, data["n_tokens"])
        data = {k: v for k, v in data.items() if k not in ("n_tokens", "sampled_tokens")}
        data.update(token_ids=token_ids.tolist(), mask=list(mask), logprobs=logprobs.tolist())
    if kind == "batch_shipped":
        data = {k: v for k, v in data.items() if k != "sha256"}
    if kind == "background_finalized":  # version 1 logged a background result as group_finalized
        return "group_finalized", data
    if kind == "version_published" and data.get("metrics") is None:
        # The trainer's figures, a field added since with a null default; the simulated trainer
        # reports none.
        data = {k: v for k, v in data.items() if k != "metrics"}
    if kind == "run_started":
        data = {**data, "schema_version": 1, "params": {k: v for k, v in data["params"].items() if k not in PINNED}}
    return kind, data


def digest(events: list) -> str:
    h = hashlib.sha256()
    for event in events:
        kind, data, payload = ev.encode_event(event)
        kind, fields = as_recorded(kind, orjson.loads(data), payload)
        h.update(kind.encode() + b"\0" + orjson.dumps(fields, option=orjson.OPT_SORT_KEYS) + b"\n")
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

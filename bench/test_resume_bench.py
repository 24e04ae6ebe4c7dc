"""Resume (fold) time against log length, without and with a snapshot.

    .venv/bin/python -m pytest bench/test_resume_bench.py -o addopts= --benchmark-only -s

Logs of 10k, 100k and 1M events are produced by the simulated world (real decide/evolve) and
appended with durability=normal in large commits; they are cached under bench/results/.cache so
repeated runs skip the generation. "cold" folds every event; "snapshot" also stores a snapshot
10k events before the end and folds from it, as a resume does.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from eventlog import EventLog
from orchestrator.core import events as ev
from orchestrator.core.state import REDUCER_VERSION, state_bytes, state_hash
from orchestrator.fold import fold_log
from orchestrator.gc_tuning import tuned_gc
from tests.support.sim import SimOptions, SimWorld

CACHE = Path(__file__).parent / "results" / ".cache"
SIZES = {"10k": 10_000, "100k": 100_000, "1M": 1_000_000}


def build_log(path: Path, n_events: int) -> None:
    """Append at least n_events events of a simulated run, with a snapshot 10k before the end."""
    params = ev.CoreParams(
        env_ratios={"a": 1.0, "b": 1.0},
        group_size=8,
        batch_size=64,
        max_inflight=256,
        max_steps=10**9,
        max_off_policy_steps=2,
        zero_output_batches=10**6,
    )
    world = SimWorld(params, seed=3, options=SimOptions(publish_weight=0.5, max_tokens=16))
    world.start()
    tmp = path.with_suffix(".tmp")
    for suffix in ("", "-wal", "-shm", ".lock"):
        Path(str(tmp) + suffix).unlink(missing_ok=True)
    snapshot_at = max(1, n_events - 10_000)
    with EventLog.create(tmp, durability="normal") as log:
        written = 0
        while written < n_events:
            for _ in range(2000):
                world.advance()
            for event in world.log:
                log.append_json(*ev.encode_event(event))
            log.commit()
            before, written = written, written + len(world.log)
            world.log.clear()
            if before < snapshot_at <= written:
                log.save_snapshot(log.last_seq, REDUCER_VERSION, state_bytes(world.state))
        log.set_meta("state_hash", state_hash(world.state))
        log.checkpoint()
    tmp.rename(path)


@pytest.fixture(scope="module")
def logs():
    CACHE.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, n in SIZES.items():
        # Keyed by the reducer and event format versions: the stored state hash and snapshot are
        # in the one's format, the events in the other's.
        path = CACHE / f"resume-{name}-{REDUCER_VERSION}-events-v{ev.EVENT_SCHEMA_VERSION}.db"
        if not path.exists():
            started = time.perf_counter()
            build_log(path, n)
            print(f"\nbuilt {name} log in {time.perf_counter() - started:.1f}s")
        paths[name] = path
    return paths


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("mode", ["cold", "snapshot"])
def test_resume_fold_time(benchmark, logs, size, mode):
    path = logs[size]

    def resume():
        with EventLog.open_reader(path) as log, tuned_gc():  # as `orch run --resume` does
            folded = fold_log(log, use_snapshots=(mode == "snapshot"))
            expected = log.meta["state_hash"]
        return folded, expected

    folded, expected = benchmark.pedantic(resume, rounds=3, iterations=1)
    assert state_hash(folded.state) == expected  # the fold rebuilt exactly the live state
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(events=folded.seq, folded=folded.events_folded, seconds=round(seconds, 3))
    print(f"\nresume {size} {mode}: {folded.seq} events, folded {folded.events_folded} in {seconds:.2f}s")

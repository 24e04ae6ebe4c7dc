"""Replay benchmarks: `orch replay --diff` of two 1M-event logs — time, events/s, peak memory.

    python -m pytest bench/test_replay_bench.py -o addopts= --benchmark-only -s

The logs are a long SimWorld run (the real core; env completions, publishes) encoded and appended
in large commits with durability=normal: about a minute to build, then cached in the temp dir
(ORCH_REPLAY_BENCH_CACHE to move it; ORCH_REPLAY_BENCH_EVENTS to change the size). B is a
byte copy of A (the worst case: every event compared), B' the same with one batch changed near
the end (the divergence must be found there, and reported precisely).

Memory: each measurement runs `diff_logs` in a fresh subprocess, once for ru_maxrss growth over
the process's baseline after imports, once under tracemalloc for the Python heap peak, for the
full logs and for logs a tenth as long. Streaming means the two peaks are about the same.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pytest

from eventlog import FORMAT_VERSION, EventLog
from eventlog.fileformat import row_hash
from orchestrator.core import events as ev
from orchestrator.orch_log import LOG_MAGIC_META
from replay.diff import diff_logs
from replay.source import open_run
from tests.support.sim import SimOptions, SimWorld

N = int(os.environ.get("ORCH_REPLAY_BENCH_EVENTS", 1_000_000))
SMALL = max(N // 10, 1000)
# Bump when the generator changes, to rebuild cached logs.
# v2: the meta carries schema_version, which replay requires of every orch log
GENERATOR_VERSION = f"sim-v2-events-v{ev.EVENT_SCHEMA_VERSION}"
CACHE = Path(os.environ.get("ORCH_REPLAY_BENCH_CACHE", tempfile.gettempdir())) / "orch-replay-bench"
ROOT = Path(__file__).resolve().parents[1]


def build_log(path: Path, n_events: int, seed: int = 0) -> None:
    """At least `n_events` events of a long SimWorld run, appended in commits of a few thousand."""
    params = ev.CoreParams(
        seed=seed,
        env_ratios={"a": 1.0, "b": 1.5},
        group_size=4,
        batch_size=16,
        max_inflight=24,
        max_steps=10**7,
        max_off_policy_steps=2,
        zero_output_batches=10**7,
    )
    world = SimWorld(params, seed=seed, options=SimOptions())
    tmp = path.with_name(path.name + ".building")
    for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        leftover.unlink(missing_ok=True)
    meta = {**LOG_MAGIC_META, "bench_generator": GENERATOR_VERSION, "bench_events": str(n_events)}
    encode = ev.encode_event
    written = 0
    with EventLog.create(tmp, meta=meta, durability="normal") as log:
        world.start()
        while written < n_events:
            for _ in range(2000):
                world.advance()
            for event in world.log:
                log.append_json(*encode(event))
            written += len(world.log)
            world.log.clear()
            log.commit()
        log.checkpoint()
    os.replace(tmp, path)


def _cached(path: Path, n_events: int) -> bool:
    try:
        with EventLog.open_reader(path) as log:
            meta = log.meta
            fresh = meta.get("bench_generator") == GENERATOR_VERSION and meta.get("bench_events") == str(n_events)
            return fresh and log.format_version == FORMAT_VERSION  # a log of an older format is rebuilt
    except Exception:
        return False


def _copy(src: Path, dst: Path) -> None:
    for leftover in (dst, Path(f"{dst}-wal"), Path(f"{dst}-shm")):
        leftover.unlink(missing_ok=True)
    shutil.copyfile(src, dst)


@pytest.fixture(scope="module")
def logs() -> dict:
    CACHE.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in (("a", N), ("small_a", SMALL)):
        path = CACHE / f"{name}-{n}.db"
        if not _cached(path, n):
            started = time.perf_counter()
            build_log(path, n)
            print(f"\nbuilt {path} ({n} events) in {time.perf_counter() - started:.1f}s")
        out[name] = path
    out["b"], out["small_b"] = CACHE / f"b-{N}.db", CACHE / f"small_b-{SMALL}.db"
    _copy(out["a"], out["b"])
    _copy(out["small_a"], out["small_b"])
    # B': one batch near the end changed (its sha256)
    out["b_div"] = CACHE / f"b_div-{N}.db"
    _copy(out["a"], out["b_div"])
    with sqlite3.connect(out["b_div"]) as db:
        (last,) = db.execute("SELECT max(seq) FROM events").fetchone()
        seq, data = db.execute(
            "SELECT seq, data FROM events WHERE kind = 'batch_shipped' AND seq < ? ORDER BY seq DESC LIMIT 1",
            (last - 1000,),
        ).fetchone()
        changed = orjson.dumps({**orjson.loads(data), "sha256": "f" * 64})  # as other code would record it
        db.execute(
            "UPDATE events SET data = ?, row_hash = ? WHERE seq = ?",
            (changed.decode(), row_hash("batch_shipped", changed, None), seq),
        )
    out["div_seq"] = seq
    with EventLog.open_reader(out["a"]) as log:
        out["events"] = log.last_seq
    with EventLog.open_reader(out["small_a"]) as log:
        out["small_events"] = log.last_seq
    return out


def _run_diff(a: Path, b: Path, level: str):
    with open_run(a) as la, open_run(b) as lb:
        return diff_logs(la, lb, level)


def _timed(benchmark, fn, rounds: int = 1):
    return benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)


def test_diff_events_level_1m(benchmark, logs):
    """Every event of both logs compared (inputs and decisions), identical logs."""
    result = _timed(benchmark, lambda: _run_diff(logs["a"], logs["b"], "events"))
    assert result.equivalent and result.compared == logs["events"]
    seconds = benchmark.stats.stats.mean
    benchmark.extra_info.update(
        events_per_log=logs["events"],
        seconds=round(seconds, 2),
        event_pairs_per_s=round(logs["events"] / seconds),
        rows_read_per_s=round(2 * logs["events"] / seconds),
    )
    print(
        f"\n--diff --level events, 2 x {logs['events']} events: {seconds:.2f}s, "
        f"{logs['events'] / seconds:,.0f} event pairs/s"
    )


def test_diff_batches_level_1m(benchmark, logs):
    """The default level: only batch_shipped rows come back from SQLite."""
    result = _timed(benchmark, lambda: _run_diff(logs["a"], logs["b"], "batches"), rounds=3)
    assert result.equivalent and result.compared > 0
    seconds = benchmark.stats.stats.mean
    benchmark.extra_info.update(
        events_per_log=logs["events"],
        batches=result.compared,
        seconds=round(seconds, 2),
        events_scanned_per_s=round(2 * logs["events"] / seconds),
    )
    print(f"\n--diff --level batches, 2 x {logs['events']} events ({result.compared} batches): {seconds:.2f}s")


def test_diff_accounting_level_1m(benchmark, logs):
    """Three sequence passes per log plus a fold of each log to its end state."""
    result = _timed(benchmark, lambda: _run_diff(logs["a"], logs["b"], "accounting"))
    assert result.equivalent
    seconds = benchmark.stats.stats.mean
    benchmark.extra_info.update(
        events_per_log=logs["events"],
        items=result.compared,
        seconds=round(seconds, 2),
        events_per_s=round(2 * logs["events"] / seconds),
    )
    print(f"\n--diff --level accounting, 2 x {logs['events']} events: {seconds:.2f}s")


def test_diff_finds_a_divergence_near_the_end_1m(benchmark, logs):
    result = _timed(benchmark, lambda: _run_diff(logs["a"], logs["b_div"], "events"))
    div = result.divergence
    assert not result.equivalent and div.a.seq == div.b.seq == logs["div_seq"] == result.compared + 1
    assert [(f.path, f.b) for f in div.fields] == [("sha256", "f" * 64)]
    benchmark.extra_info.update(divergence_seq=div.a.seq, seconds=round(benchmark.stats.stats.mean, 2))


_CHILD = r"""
import json, resource, sys, time, tracemalloc
from replay.diff import diff_logs
from replay.source import open_run
a, b, level, trace = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if trace:
    tracemalloc.start()
t = time.perf_counter()
with open_run(a) as la, open_run(b) as lb:
    result = diff_logs(la, lb, level)
seconds = time.perf_counter() - t
peak = tracemalloc.get_traced_memory()[1] if trace else None
print(json.dumps({"equivalent": result.equivalent, "compared": result.compared, "seconds": seconds,
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "maxrss_growth_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base,
                  "tracemalloc_peak_bytes": peak}))
"""


def _measure(a: Path, b: Path, level: str, trace: bool) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(a), str(b), level, "1" if trace else "0"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_diff_peak_memory_does_not_grow_with_log_length(benchmark, logs):
    """Peak memory of --diff --level events for N and N/10 events: the same, so it streams."""

    def measure_all():
        out = {}
        for size, (a, b) in (("small", (logs["small_a"], logs["small_b"])), ("full", (logs["a"], logs["b"]))):
            rss = _measure(a, b, "events", trace=False)
            heap = _measure(a, b, "events", trace=True)
            assert rss["equivalent"] and heap["equivalent"]
            out[size] = {
                "events": rss["compared"],
                "seconds": round(rss["seconds"], 2),
                "maxrss_mb": round(rss["maxrss_kb"] / 1024, 1),
                "maxrss_growth_mb": round(rss["maxrss_growth_kb"] / 1024, 1),
                "tracemalloc_peak_mb": round(heap["tracemalloc_peak_bytes"] / 2**20, 2),
            }
        return out

    out = _timed(benchmark, measure_all)
    small, full = out["small"], out["full"]
    benchmark.extra_info.update(out)
    for v in (small, full):
        print(
            f"\npeak memory of --diff --level events, 2 x {v['events']} events: Python heap peak "
            f"{v['tracemalloc_peak_mb']} MB, process max RSS {v['maxrss_mb']} MB (+{v['maxrss_growth_mb']} MB over "
            f"the baseline after imports), {v['seconds']}s"
        )
    assert full["maxrss_mb"] < small["maxrss_mb"] + 16.0
    assert full["events"] >= 5 * small["events"]
    assert full["tracemalloc_peak_mb"] < small["tracemalloc_peak_mb"] * 1.25 + 1.0
    assert full["maxrss_growth_mb"] < small["maxrss_growth_mb"] + 16.0

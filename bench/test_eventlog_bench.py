"""Event log benchmarks (pytest-benchmark).

    python -m pytest bench/test_eventlog_bench.py -o addopts= --benchmark-only

Figures (in each benchmark's extra_info, and printed with -s):
* append, 256 events per commit, durability full: orch vs raw sqlite3 ``executemany``
  of the same rows into the same schema, timed interleaved in the same test so
  the ratio survives a noisy shared machine;
* one event per commit (full): events/s;
* read + decode throughput (target >= 300k events/s), undecoded reads, the fold's read
  (`read_bodies`) and the replay's read with payloads (`read_rows`).

Ratios are orch/raw throughput (1.0 = as fast as hand-written sqlite3). The figures are reported,
never asserted: a shared machine's noise moves them; only a broken invariant fails a benchmark.
"""

from __future__ import annotations

import sqlite3
import statistics
import time
from pathlib import Path

import orjson
import pytest

from eventlog import EventLog
from eventlog.fileformat import SCHEMA

BATCH = 256
KIND = "episode_completed"
# A realistic small event. With "error": None the payload encodes a `null`, so the
# NaN/Infinity check has to walk it (the slower path); without, one substring test.
EVENT = {
    "episode_id": 7,
    "group_id": 3,
    "ok": True,
    "reward": 0.75,
    "token_ids": list(range(32)),
    "policy_start": 4,
    "policy_end": 5,
    "error": "",
}
EVENT_WITH_NONE = {**EVENT, "error": None}
EVENT_JSON = orjson.dumps(EVENT)


class RawLog:
    """The baseline: hand-written sqlite3, same schema, WAL, synchronous=FULL."""

    def __init__(self, path: Path):
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        for ddl in SCHEMA:
            self.conn.execute(ddl)
        self.seq = 0

    def insert(self, rows: list[tuple]) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.executemany("INSERT INTO events(seq, ts, kind, data) VALUES (?, ?, ?, ?)", rows)
        self.conn.execute("COMMIT")
        self.seq += len(rows)

    def batch_encode(self, events: list[dict]) -> None:
        """Raw with the encoding the orch path does (orjson, no NaN check)."""
        s, now = self.seq + 1, time.time()
        self.insert([(s + i, now, KIND, orjson.dumps(e).decode()) for i, e in enumerate(events)])

    def batch_json(self, docs: list[bytes]) -> None:
        """Raw with pre-encoded JSON (the counterpart of append_json)."""
        s, now = self.seq + 1, time.time()
        self.insert([(s + i, now, KIND, d.decode()) for i, d in enumerate(docs)])


def orch_batch(log: EventLog, events: list[dict]) -> None:
    append = log.append
    for e in events:
        append(KIND, e)
    log.commit()


def orch_batch_json(log: EventLog, docs: list[bytes]) -> None:
    append_json = log.append_json
    for d in docs:
        append_json(KIND, d)
    log.commit()


def report(benchmark, **figures) -> None:
    benchmark.extra_info.update(figures)
    print("\n  " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def interleaved(fn_a, fn_b, rounds: int) -> dict[str, float]:
    """Run fn_a and fn_b alternately (order swapped each round) and compare them.

    Returns the median seconds of each and two ratios t_b / t_a: the median of
    per-round ratios (each pair ran back to back, so slow drifts of a shared
    machine cancel) and the ratio of the minima (least disturbed runs).
    """
    ta, tb = [], []
    for r in range(rounds):
        for fn, acc in ((fn_a, ta), (fn_b, tb)) if r % 2 else ((fn_b, tb), (fn_a, ta)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return {
        "a": statistics.median(ta),
        "b": statistics.median(tb),
        "paired_ratio": statistics.median(b / a for a, b in zip(ta, tb)),
        "min_ratio": min(tb) / min(ta),
    }


@pytest.fixture
def orch_log(tmp_path):
    log = EventLog.create(tmp_path / "orch.db", durability="full")
    yield log
    log.close()


@pytest.fixture
def raw_log(tmp_path):
    raw = RawLog(tmp_path / "raw.db")
    yield raw
    raw.conn.close()


# ---------------------------------------------------------------- append, 256 per commit


def test_append_256_full_orch(benchmark, orch_log):
    events = [EVENT] * BATCH
    benchmark.pedantic(orch_batch, args=(orch_log, events), rounds=200, warmup_rounds=10)
    report(benchmark, events_per_s=round(BATCH / benchmark.stats.stats.median))


def test_append_256_full_raw(benchmark, raw_log):
    events = [EVENT] * BATCH
    benchmark.pedantic(raw_log.batch_encode, args=(events,), rounds=200, warmup_rounds=10)
    report(benchmark, events_per_s=round(BATCH / benchmark.stats.stats.median))


@pytest.mark.parametrize("mode", ["append", "append_with_none", "append_json"])
def test_append_256_full_ratio(benchmark, orch_log, raw_log, mode):
    """orch throughput / raw sqlite3 throughput, both measured interleaved in this test.

    append: orch.append(dict) vs raw orjson.dumps + executemany;
    append_with_none: the same with a payload holding None (NaN check walks it);
    append_json: orch.append_json(bytes) vs raw executemany of the same bytes.
    """
    if mode == "append_json":
        docs = [EVENT_JSON] * BATCH
        orch_fn, raw_fn = (lambda: orch_batch_json(orch_log, docs)), (lambda: raw_log.batch_json(docs))
    else:
        events = [EVENT_WITH_NONE if mode == "append_with_none" else EVENT] * BATCH
        orch_fn, raw_fn = (lambda: orch_batch(orch_log, events)), (lambda: raw_log.batch_encode(events))
    figures = {}

    def measure() -> None:
        m = interleaved(orch_fn, raw_fn, rounds=200)
        figures.update(
            orch_events_per_s=round(BATCH / m["a"]),
            raw_events_per_s=round(BATCH / m["b"]),
            ratio_paired_median=round(m["paired_ratio"], 3),
            ratio_of_minima=round(m["min_ratio"], 3),
        )

    benchmark.pedantic(measure, rounds=1, iterations=1)
    report(benchmark, mode=mode, **figures, target_ratio=0.9)


def test_commit_in_a_worker_beside_a_busy_thread(benchmark, orch_log, raw_log):
    """The loop commits in a worker thread while it keeps running Python code: each time
    sqlite3 takes the GIL back after a statement step, it may wait for the switch interval.
    The commit of 256 buffered events, in a worker, while another thread spins: orch
    (multi-row statements) vs raw executemany (one step per row), interleaved."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    stop, worker = threading.Event(), ThreadPoolExecutor(1)

    def spin() -> None:
        while not stop.is_set():
            pass

    def in_worker(fn) -> None:
        worker.submit(fn).result()  # as the loop's asyncio.to_thread(log.commit)

    def orch_commit() -> None:
        for _ in range(BATCH):
            orch_log.append_json(KIND, EVENT_JSON)
        in_worker(orch_log.commit)

    def raw_commit() -> None:
        s, now = raw_log.seq + 1, time.time()
        rows = [(s + i, now, KIND, EVENT_JSON.decode()) for i in range(BATCH)]
        in_worker(lambda: raw_log.insert(rows))

    figures = {}

    def measure() -> None:
        busy = threading.Thread(target=spin)
        busy.start()
        try:
            m = interleaved(orch_commit, raw_commit, rounds=10)
        finally:
            stop.set()
            busy.join()
            worker.shutdown()
        figures.update(
            orch_ms=round(m["a"] * 1000, 1),
            raw_ms=round(m["b"] * 1000, 1),
            speedup_paired_median=round(m["paired_ratio"], 1),
        )

    benchmark.pedantic(measure, rounds=1, iterations=1)
    report(benchmark, **figures)
    assert orch_log.last_seq == raw_log.seq == 10 * BATCH  # every commit landed, on both sides


# ---------------------------------------------------------------- one event per commit


def test_append_1_per_commit_full(benchmark, orch_log):
    def one() -> None:
        orch_log.append(KIND, EVENT)
        orch_log.commit()

    benchmark.pedantic(one, rounds=500, warmup_rounds=20)
    report(benchmark, events_per_s=round(1 / benchmark.stats.stats.median))


def test_append_1_per_commit_full_raw(benchmark, raw_log):
    benchmark.pedantic(raw_log.batch_encode, args=([EVENT],), rounds=500, warmup_rounds=20)
    report(benchmark, events_per_s=round(1 / benchmark.stats.stats.median))


# ---------------------------------------------------------------- read


READ_N = 100_000  # events in the log
READ_SLICE = 20_000  # events per timed round: short rounds, so the best one catches a quiet moment


@pytest.fixture(scope="module")
def filled_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("read") / "events.db"
    with EventLog.create(path, durability="normal") as log:
        for start in range(0, READ_N, 5000):
            for i in range(start, start + 5000):
                log.append(KIND, {**EVENT, "episode_id": i})
            log.commit()
    return path


def read_rates(benchmark, n: int) -> dict[str, int]:
    stats = benchmark.stats.stats
    return {"events_per_s_median": round(n / stats.median), "events_per_s_best": round(n / stats.min)}


@pytest.mark.parametrize("method", ["read", "read_raw", "read_bodies", "read_rows"])
def test_read(benchmark, filled_path, method):
    """read: each event decoded; read_raw: undecoded rows; read_bodies: the fold's read, (kind,
    data bytes) of each seq; read_rows: the replay's read, each row with its payload, checked
    against its checksum."""
    reader = EventLog.open_reader(filled_path)
    read = getattr(reader, method)
    n = benchmark.pedantic(lambda: sum(1 for _ in read(40_001, 40_000 + READ_SLICE)), rounds=20, warmup_rounds=1)
    reader.close()
    assert n == READ_SLICE
    target = {"target_events_per_s": 300_000} if method == "read" else {}
    report(benchmark, **read_rates(benchmark, READ_SLICE), **target)

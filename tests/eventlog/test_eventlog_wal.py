"""The WAL stays bounded: in a long run, and when a reader starved the checkpoints."""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest

import eventlog.log as eventlog_log
from eventlog import EventLog

MiB = 1 << 20


def wal_size(path: str) -> int:
    try:
        return os.path.getsize(path + "-wal")
    except FileNotFoundError:
        return 0


def test_new_logs_use_16k_pages_and_checkpoint_every_4_mib(log, path):
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA page_size").fetchone() == (16384,)
    finally:
        db.close()
    assert log._conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (4 * MiB // 16384,)


def test_forced_checkpoint_after_a_reader_pinned_the_wal(log, path, monkeypatch):
    monkeypatch.setattr(eventlog_log, "_WAL_FORCE_BYTES", 1 * MiB)
    pin = sqlite3.connect(path, isolation_level=None)
    pin.execute("BEGIN")
    pin.execute("SELECT count(*) FROM events").fetchone()  # holds a read snapshot: no checkpoint can finish
    payload = {"pad": "x" * 1000}
    for _ in range(40):  # ~3 MiB, below the 4 MiB passive auto-checkpoint
        for _ in range(80):
            log.append("k", payload)
        log.commit()
    assert wal_size(path) > 2 * MiB
    pin.execute("COMMIT")
    pin.close()
    for _ in range(eventlog_log._WAL_CHECK_EVERY):
        log.append("k", 1)
        log.commit()
    assert wal_size(path) < 1 * MiB
    assert log.verify().ok


@pytest.mark.slow
def test_wal_stays_bounded_over_a_million_events(log, path):
    """1M+ events, 2000 per commit (durability full), with a reader tailing the log."""
    bound = 16 * MiB
    n_batches, per_batch = 520, 2000
    stop = threading.Event()
    tail_reads = []

    def tail() -> None:
        with EventLog.open_reader(path) as reader:
            seen = 0
            while not stop.is_set():
                for rec in reader.read_raw(seen + 1, chunk_size=4096):
                    seen = rec[0]
                tail_reads.append(seen)
                time.sleep(0.1)

    reader = threading.Thread(target=tail)
    reader.start()
    biggest = 0
    try:
        payload = {"episode_id": 0, "reward": 0.5, "token_ids": list(range(16)), "ok": True}
        for _ in range(n_batches):
            for _ in range(per_batch):
                log.append("episode_completed", payload)
            log.commit()
            biggest = max(biggest, wal_size(path))
    finally:
        stop.set()
        reader.join()
    assert log.last_seq == n_batches * per_batch >= 1_000_000
    assert biggest < bound, f"WAL grew to {biggest / MiB:.1f} MiB"
    assert tail_reads and max(tail_reads) > 0
    assert log.verify().ok

"""Crash loop: a writer process is SIGKILLed at random moments, again and again.

After every kill the log must verify, be contiguous from seq 1, hold every
batch the writer acknowledged (ACK is printed only after commit() returned),
and hold no batch partly.  The next writer reopens the same file and continues.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from eventlog_testutil import spawn_child

from eventlog import EventLog


def parse_acks(out: str) -> dict[int, tuple[int, int]]:
    """batch id -> (first seq, last seq) for every complete ACK line."""
    acks = {}
    for line in out.splitlines(keepends=True):
        parts = line.split()
        if line.endswith("\n") and len(parts) == 4 and parts[0] == "ACK":
            acks[int(parts[1])] = (int(parts[2]), int(parts[3]))
    return acks


def batches_in(records) -> list[tuple[int, int, int]]:
    """Split records into (batch id, first seq, last seq), asserting each batch is whole."""
    batches = []
    i = 0
    while i < len(records):
        first = records[i]
        b, n = first.data["b"], first.data["n"]
        group = records[i : i + n]
        assert [r.data["i"] for r in group] == list(range(n)), f"batch {b} is partial"
        assert all(r.data["b"] == b and r.data["n"] == n for r in group), f"batch {b} is mixed"
        batches.append((b, group[0].seq, group[-1].seq))
        i += n
    return batches


def check_log(path: str, acked: dict[int, tuple[int, int]], as_writer: bool) -> int:
    """Assert the post-crash invariants; return the number of batches stored."""
    opener = EventLog.open if as_writer else EventLog.open_reader
    with opener(path) as lg:
        report = lg.verify()
        assert report.ok, report.problems
        records = list(lg.read())
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    batches = batches_in(records)
    assert [b for b, _, _ in batches] == list(range(len(batches))), "batch ids not consecutive"
    stored = {b: (lo, hi) for b, lo, hi in batches}
    for b, seq_range in acked.items():
        assert stored.get(b) == seq_range, f"acknowledged batch {b} {seq_range} lost or moved"
    return len(batches)


def crash_loop(path: str, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    acked: dict[int, tuple[int, int]] = {}
    for round_no in range(rounds):
        # Mostly kill mid-append; sometimes during start-up (create/open/recovery).
        early = round_no % 5 == 4
        durability = "full" if round_no % 3 else "normal"
        proc = spawn_child("writer", path, str(seed * 1000 + round_no), durability, wait_ready=not early)
        time.sleep(rng.uniform(0.0, 0.15) if early else rng.uniform(0.0, 0.08))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err
        acked.update(parse_acks(out))
        stored = check_log(path, acked, as_writer=bool(round_no % 2))
        assert stored >= len(acked)
    assert len(acked) > rounds, "the writer barely committed anything: the test proved little"


def test_crash_loop_short(tmp_path):
    crash_loop(str(tmp_path / "events.db"), rounds=6, seed=1)


@pytest.mark.slow
def test_crash_loop_30_rounds(tmp_path):
    crash_loop(str(tmp_path / "events.db"), rounds=32, seed=2)

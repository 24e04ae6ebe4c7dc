"""A writer never opens a damaged log: EventLog.open runs SQLite's quick_check first and
refuses, in one line naming the file, before it writes anything (not even the removal of
unreferenced side files)."""

from __future__ import annotations

import hashlib
import os
import sqlite3

import pytest

from eventlog import CorruptLogError, EventLog


def _filled_log(path: str, events: int = 3000) -> None:
    with EventLog.create(path) as log:
        for i in range(events):
            log.append("tick", {"i": i, "pad": "x" * 200})
        log.append("big", {}, payload=os.urandom(200 * 1024))  # one side file


def _damage_page(path: str, page: int) -> None:
    with open(path, "r+b") as f:
        f.seek(page * 16384)
        f.write(b"\xa5" * 4096)


def test_open_refuses_a_damaged_log_and_writes_nothing(path):
    _filled_log(path)
    side = path + ".payloads"
    orphan = os.path.join(side, "0" * 64)  # what a writer's open would remove
    open(orphan, "wb").close()
    _damage_page(path, os.path.getsize(path) // 16384 // 2)
    before = hashlib.sha256(open(path, "rb").read()).hexdigest()
    with pytest.raises(CorruptLogError, match=r"events\.db is damaged \(SQLite's quick_check: ") as refused:
        EventLog.open(path)
    assert "\n" not in str(refused.value) and path in str(refused.value)
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == before
    assert os.path.exists(orphan)


def test_a_sound_log_opens_as_before(path):
    _filled_log(path, events=10)
    with EventLog.open(path) as log:
        assert log.last_seq == 11


def _rows(path: str) -> list[tuple]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT seq, ts, kind, data, payload, payload_ref FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()


def test_damaged_snapshots_are_folded_around_and_the_writer_rebuilds_the_file_without_them(path):
    with EventLog.create(path) as log:
        for i in range(40):
            log.append("tick", {"i": i})
            log.commit()
            log.save_snapshot(log.last_seq, "r1", os.urandom(60_000))  # overflow pages: a tree of its own
        big = os.urandom(200 * 1024)
        log.append("big", {}, payload=big)  # in a side file
    rows = _rows(path)
    (root,) = sqlite3.connect(path).execute("SELECT rootpage FROM sqlite_master WHERE name = 'snapshots'").fetchone()
    _damage_page(path, root - 1)
    with EventLog.open_reader(path) as reader:
        assert reader.load_snapshot("r1") is None  # skipped: the fold starts from the first event
        assert [r.seq for r in reader.read()] == list(range(1, 42))
    with EventLog.open(path) as log:
        assert log.damaged_copy == path + ".damaged-1" and os.path.exists(log.damaged_copy)
        assert log.load_snapshot("r1") is None
        assert log.read_payloads([41]) == {41: big}  # its side file, the same file
        log.append("after", {})
    assert _rows(path)[:-1] == rows  # every event as it was, byte for byte
    assert [r[0] for r in sqlite3.connect(path).execute("PRAGMA quick_check")] == ["ok"]


def test_damage_beyond_the_snapshots_is_refused_not_rebuilt(path):
    _filled_log(path)
    (root,) = sqlite3.connect(path).execute("SELECT rootpage FROM sqlite_master WHERE name = 'events'").fetchone()
    _damage_page(path, root - 1)
    with pytest.raises(CorruptLogError):
        EventLog.open(path)
    assert not os.path.exists(path + ".damaged-1")

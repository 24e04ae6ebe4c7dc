"""A writer never opens a damaged log: EventLog.open runs SQLite's quick_check first and
refuses, in one line naming the file, before it writes anything (not even the removal of
unreferenced side files)."""

from __future__ import annotations

import hashlib
import os

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

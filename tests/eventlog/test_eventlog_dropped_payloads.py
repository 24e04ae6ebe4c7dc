"""Dropped payloads in the SQLite log (docs/log-format.md, "Dropped token arrays"): the row keeps
the payload's sha256 in `payload_ref` and a checksum over it, so it still verifies; a side file
every piece of which is dropped is deleted; a damaged row is never dropped (nor re-hashed); the
pages freed are reused by later rows."""

from __future__ import annotations

import hashlib
import os
import sqlite3

import pytest

from eventlog import CorruptLogError, EventLog, PayloadDroppedError
from eventlog.fileformat import stored_row_hash
from eventlog.sidefiles import side_dir


@pytest.fixture
def log(tmp_path):
    log = EventLog.create(tmp_path / "events.db")
    log.side_file_bytes = 1000
    yield log
    log.close()


def _row(path: str, seq: int) -> tuple:
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT kind, data, payload, payload_ref, row_hash FROM events WHERE seq = ?", (seq,)
        ).fetchone()


def test_a_dropped_row_holds_the_sha256_of_its_payload_and_still_verifies(log):
    small, big = b"s" * 10, os.urandom(5000)
    log.append("e", {"n": 1}, small)
    log.append("e", {"n": 2}, big)  # in a side file
    log.commit()
    assert log.drop_payloads([1, 2]) == [1, 2]
    for seq, payload in ((1, small), (2, big)):
        kind, data, stored, ref, check = _row(log.path, seq)
        assert (stored, ref) == (None, "dropped:" + hashlib.sha256(payload).hexdigest())
        assert check == stored_row_hash(kind, data.encode(), None, ref)  # over the reference, as for a side file
    assert log.verify().ok  # neither damage nor a missing side file
    assert log.damaged_rows() == {}


def test_a_side_file_is_deleted_once_every_piece_of_it_is_dropped_and_not_before(log):
    first, second = os.urandom(5000), os.urandom(6000)
    log.append("e", {}, first)
    log.append("e", {}, second)
    log.commit()
    [name] = os.listdir(side_dir(log.path))
    log.drop_payloads([1])
    assert os.listdir(side_dir(log.path)) == [name]  # its second piece is still referenced
    assert log.read_payloads([2]) == {2: second}
    log.drop_payloads([2])
    assert os.listdir(side_dir(log.path)) == []


def test_a_side_file_shared_by_two_commits_stays_while_either_references_it(log):
    big = os.urandom(5000)
    for _ in range(2):  # the same content: one content-addressed file
        log.append("e", {}, big)
        log.commit()
    [name] = os.listdir(side_dir(log.path))
    log.drop_payloads([1])
    assert os.listdir(side_dir(log.path)) == [name]
    assert log.read_payloads([2]) == {2: big}


def test_a_row_that_fails_its_checksum_is_not_dropped_and_stays_damage(log):
    log.append("e", {"n": 1}, b"abc")
    log.commit()
    with sqlite3.connect(log.path) as db:
        db.execute("UPDATE events SET payload = ? WHERE seq = 1", (b"abd",))
    assert log.drop_payloads([1]) == []
    assert _row(log.path, 1)[2] == b"abd"
    with pytest.raises(CorruptLogError, match="seq 1: its data or payload fails its checksum"):
        log.read_payloads([1])


def test_a_dropped_reference_edited_by_hand_fails_its_checksum(log):
    log.append("e", {}, b"abc")
    log.commit()
    log.drop_payloads([1])
    with sqlite3.connect(log.path) as db:
        db.execute("UPDATE events SET payload_ref = 'dropped:' || hex(zeroblob(32)) WHERE seq = 1")
    assert not log.verify().ok
    with pytest.raises(CorruptLogError):
        log.read_payloads([1])


def test_a_reader_and_a_reopened_writer_see_the_drop(log):
    log.append("e", {}, b"abc")
    log.commit()
    log.drop_payloads([1])
    path = log.path
    log.close()
    for opened in (EventLog.open_reader(path), EventLog.open(path)):
        with opened:
            with pytest.raises(PayloadDroppedError, match="seq 1: its payload was dropped"):
                opened.read_payloads([1])


def test_the_pages_a_drop_frees_are_reused_so_the_file_stops_growing(tmp_path):
    """No auto_vacuum needed: SQLite puts the pages a drop frees on its freelist and the next
    inserts take them, so a log that drops as much as it appends keeps its size (within a few
    pages) where each round appends 1 MB of payloads."""
    log = EventLog.create(tmp_path / "events.db")
    payload = os.urandom(20000)  # in its row (part in the leaf page, the rest overflow), like a trace's
    sizes = []
    for round_ in range(16):
        first = log.next_seq
        for i in range(50):
            log.append("e", {"round": round_, "i": i}, payload)
        log.commit()
        if round_:
            log.drop_payloads(range(first - 50, first))
        log.checkpoint()
        sizes.append(os.path.getsize(log.path))
    log.close()
    assert sizes[-1] - sizes[6] <= 4 * 16384, sizes

"""Payloads over SIDE_FILE_BYTES live in content-addressed side files, durable before the commit
that references them; a missing or damaged one is a one-line error naming it."""

from __future__ import annotations

import os

import pytest

from eventlog import CorruptLogError, EventLog, StorageError
from eventlog.sidefiles import side_dir


@pytest.fixture
def log(tmp_path):
    log = EventLog.create(tmp_path / "events.db")
    log.side_file_bytes = 1000
    yield log
    log.close()


def test_large_payloads_of_a_commit_share_one_side_file_and_read_back(log):
    small, big, bigger = b"s" * 10, os.urandom(5000), os.urandom(7000)
    for payload in (small, big, None, bigger):
        log.append("e", {"n": 1}, payload)
    log.commit()
    [name] = os.listdir(side_dir(log.path))
    assert os.path.getsize(os.path.join(side_dir(log.path), name)) == len(big) + len(bigger)
    assert [row[4] for row in log.read_rows()] == [small, big, None, bigger]
    assert log.read_payloads([1, 2, 3, 4]) == {1: small, 2: big, 4: bigger}
    log.append("e", {"n": 2}, big)  # the same large payloads again: the same file, not a second one
    log.append("e", {"n": 2}, bigger)
    log.commit()
    assert os.listdir(side_dir(log.path)) == [name]


@pytest.mark.parametrize("damage", ["deleted", "flipped"])
def test_a_missing_or_damaged_side_file_is_one_line_naming_it(log, damage):
    log.append("e", {}, os.urandom(5000))
    log.commit()
    [name] = os.listdir(side_dir(log.path))
    path = os.path.join(side_dir(log.path), name)
    if damage == "deleted":
        os.unlink(path)
    else:
        with open(path, "r+b") as f:
            f.write(b"\0\0\0")
    with pytest.raises(CorruptLogError) as info:
        log.read_payloads([1])
    message = str(info.value)
    assert "\n" not in message and "seq 1" in message and path in message
    assert ("missing" if damage == "deleted" else "damaged") in message


def test_a_side_file_that_cannot_be_written_stores_nothing_of_its_commit(log, monkeypatch):
    log.append("e", {}, b"x")
    log.commit()
    real_open = open

    def full_disk(path, *args, **kwargs):
        if ".payloads" in str(path):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    log.append("e", {}, os.urandom(5000))
    with pytest.raises(StorageError, match="cannot write the payload file .*No space left"):
        log.commit()
    monkeypatch.undo()
    assert log.last_seq == 1 and [row[0] for row in log.read_rows()] == [1]


def test_reopening_the_writer_removes_side_files_no_row_references(tmp_path):
    """A crash between a side file and its commit leaves the file (or its .tmp-) behind: the next
    writer removes it and keeps every referenced one."""
    path = tmp_path / "events.db"
    with EventLog.create(path) as log:
        log.side_file_bytes = 1000
        kept = os.urandom(5000)
        log.append("e", {}, kept)
        log.commit()
        [referenced] = os.listdir(side_dir(log.path))
    for orphan in ("ab" * 32, f"{'cd' * 32}.tmp-123"):
        (tmp_path / "events.db.payloads" / orphan).write_bytes(b"never committed")
    (tmp_path / "events.db.payloads" / "notes.txt").write_text("not orch's")
    with EventLog.open(path) as log:
        assert sorted(os.listdir(side_dir(log.path))) == sorted([referenced, "notes.txt"])
        assert log.read_payloads([1]) == {1: kept}


def test_verify_names_a_missing_or_damaged_side_file(log):
    log.append("e", {}, os.urandom(5000))
    log.append("e", {}, b"small")
    log.commit()
    assert log.verify().ok
    [name] = os.listdir(side_dir(log.path))
    with open(os.path.join(side_dir(log.path), name), "r+b") as f:
        f.write(b"\0\0\0")
    report = log.verify()
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith("seq 1: its payload file ") and "damaged" in report.problems[0]

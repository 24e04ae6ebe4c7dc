"""Each bad input maps to its typed error with a one-line message."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess

import pytest
from eventlog_testutil import spawn_child

from eventlog import (
    CorruptLogError,
    EventLog,
    ForeignDatabaseError,
    LogError,
    LogExistsError,
    LogNotFoundError,
    NewerFormatError,
    NotSQLiteError,
    OlderFormatError,
    ReadOnlyLocationError,
    StorageError,
    WriterLockedError,
)
from eventlog.lock import WriterLock

OPENERS = {"open": EventLog.open, "open_reader": EventLog.open_reader}


def raises_one_line(exc_type, fn, *args, **kwargs) -> LogError:
    """Assert fn raises exc_type with a one-line message; return the error."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return info.value


def make_log(path: str, n: int = 0, pad: int = 0) -> None:
    with EventLog.create(path) as lg:
        for i in range(n):
            lg.append("k", {"i": i, "pad": "x" * pad})


# ---------------------------------------------------------------- missing / existing


@pytest.mark.parametrize("opener", OPENERS)
def test_missing_file(path, opener):
    raises_one_line(LogNotFoundError, OPENERS[opener], path)
    assert not os.path.exists(path)


def test_create_in_missing_directory(tmp_path):
    raises_one_line(LogNotFoundError, EventLog.create, str(tmp_path / "nope" / "events.db"))


def test_create_over_existing_log_or_file(path, tmp_path):
    make_log(path, 3)
    raises_one_line(LogExistsError, EventLog.create, path)
    other = tmp_path / "plain.txt"
    other.write_text("keep me")
    raises_one_line(LogExistsError, EventLog.create, str(other))
    assert other.read_text() == "keep me"
    assert EventLog.open_reader(path).last_seq == 3


def test_create_refuses_a_leftover_wal(path):
    with open(path + "-wal", "wb") as f:
        f.write(b"stale wal from an earlier log")
    raises_one_line(LogExistsError, EventLog.create, path)


# ---------------------------------------------------------------- not ours


@pytest.mark.parametrize("opener", OPENERS)
def test_not_sqlite(path, tmp_path, opener):
    with open(path, "w") as f:
        f.write("this is a text file, long enough to hold an SQLite header, " * 4)
    raises_one_line(NotSQLiteError, OPENERS[opener], path)
    raises_one_line(NotSQLiteError, OPENERS[opener], str(tmp_path))  # a directory
    with open(path, "wb") as f:
        f.write(b"short")
    raises_one_line(NotSQLiteError, OPENERS[opener], path)


@pytest.mark.parametrize("opener", OPENERS)
def test_foreign_sqlite(path, opener):
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users(id INTEGER PRIMARY KEY, name TEXT)")
    db.close()
    raises_one_line(ForeignDatabaseError, OPENERS[opener], path)
    with sqlite3.connect(path) as db:  # a meta table, but not our magic
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
        db.execute("INSERT INTO meta VALUES ('format_version', '1')")
    db.close()
    raises_one_line(ForeignDatabaseError, OPENERS[opener], path)
    with sqlite3.connect(path) as db:  # still untouched: not switched to WAL by us
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    db.close()


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize(
    "version, error, fragment",
    [
        ("4", NewerFormatError, "version 4"),
        ("1", OlderFormatError, "format version 1 (no payload column); this orch reads versions 2-3 only"),
    ],
)
def test_another_format_is_refused_naming_it(path, opener, version, error, fragment):
    """Format 1 had no payload column: refused in one line, as a newer format is, not misread."""
    make_log(path, 2)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", (version,))
    db.close()
    err = raises_one_line(error, OPENERS[opener], path)
    assert fragment in str(err)


# ---------------------------------------------------------------- damaged


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize("keep", ["empty", "50 bytes", "part page", "whole pages"])
def test_truncated(path, opener, keep):
    make_log(path, 2000, pad=100)  # ~70 pages; closing checkpoints everything into the file
    size = os.path.getsize(path)
    new_size = {"empty": 0, "50 bytes": 50, "part page": size - 1000, "whole pages": size - 8192}[keep]
    os.truncate(path, new_size)
    err = raises_one_line(CorruptLogError, OPENERS[opener], path)
    assert ("is empty (0 bytes)" in str(err)) == (keep == "empty"), err


def test_corrupted_pages_fail_open_or_verify(path):
    make_log(path, 3000, pad=100)
    size = os.path.getsize(path)
    with contextlib.closing(sqlite3.connect(path)) as db:
        (page_size,) = db.execute("PRAGMA page_size").fetchone()
    with open(path, "r+b") as f:  # scribble over a few pages in the middle of the events b-tree
        f.seek(size // 2 // page_size * page_size)
        f.write(b"\xab" * 3 * page_size)
    with pytest.raises(CorruptLogError):
        with EventLog.open(path) as lg:
            lg.verify().raise_for_problems()
    with pytest.raises(CorruptLogError):
        with EventLog.open_reader(path) as lg:
            list(lg.read())


def test_corrupted_schema_page(path):
    make_log(path, 10)
    with open(path, "r+b") as f:  # page 1 past the 100-byte header: the schema table
        f.seek(100)
        f.write(b"\xff" * 200)
    for opener in OPENERS.values():
        raises_one_line(CorruptLogError, opener, path)


def test_first_seq_not_one(path):
    make_log(path, 5)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE seq = 1")
    db.close()
    raises_one_line(CorruptLogError, EventLog.open, path)
    report = EventLog.open_reader(path).verify()
    assert not report.ok and "starts at 2" in report.problems[0]
    raises_one_line(CorruptLogError, report.raise_for_problems)


def test_a_row_too_damaged_to_read_is_a_problem_verify_reports(path):
    make_log(path, 3)
    with sqlite3.connect(path) as db:  # not UTF-8: the driver cannot read the row's kind
        db.execute("UPDATE events SET kind = CAST(x'ff' AS TEXT) WHERE seq = 2")
    db.close()
    report = EventLog.open_reader(path).verify()
    assert not report.ok and "row checksums unreadable" in report.problems[-1], report.problems
    assert "decode to UTF-8" in report.problems[-1] and "\n" not in report.problems[-1]


# ---------------------------------------------------------------- writer lock


def test_second_writer_in_same_process(log, path):
    err = raises_one_line(WriterLockedError, EventLog.open, path)
    assert str(os.getpid()) in str(err) and err.pid == os.getpid()
    raises_one_line(LogExistsError, EventLog.create, path)
    assert EventLog.open_reader(path).last_seq == 0  # readers never take the lock
    log.close()
    EventLog.open(path).close()  # released by close()


def test_a_symlink_to_the_log_takes_the_same_writer_lock(log, path, tmp_path):
    alias = tmp_path / "alias.db"
    alias.symlink_to(path)
    raises_one_line(WriterLockedError, EventLog.open, str(alias))
    log.close()
    EventLog.open(str(alias)).close()


def test_a_lock_file_removed_between_the_creators_opens_is_created_again(path, monkeypatch):
    """Another creator's release (`release_and_remove`) unlinks the lock file after this one's
    O_EXCL open found it and before its reopen: the O_EXCL open is tried again, and succeeds."""
    lock = WriterLock(path)
    open(lock.path, "w").close()
    real_open = os.open

    def open_after_a_release(file, flags, *args):
        if file == lock.path and not flags & os.O_EXCL and os.path.exists(lock.path):
            os.unlink(lock.path)  # the other creator's release_and_remove, just now
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", open_after_a_release)
    lock.acquire()
    monkeypatch.undo()
    try:
        assert os.path.exists(lock.path)
        raises_one_line(WriterLockedError, WriterLock(path).acquire)
    finally:
        lock.release()


def test_writer_in_another_process_then_sigkill_releases(path):
    make_log(path, 1)
    proc = spawn_child("hold", path)
    try:
        err = raises_one_line(WriterLockedError, EventLog.open, path)
        assert f"pid {proc.pid}" in str(err) and err.pid == proc.pid
        with EventLog.open_reader(path) as reader:
            assert reader.last_seq == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    with EventLog.open(path) as lg:
        assert lg.last_seq == 1


def test_lock_released_when_handle_is_garbage_collected(path):
    lg = EventLog.create(path)
    del lg
    import gc

    gc.collect()
    EventLog.open(path).close()


# ---------------------------------------------------------------- read-only location


class ReadOnly:
    """Make a file or directory unwritable, even for root (chattr +i), and undo it."""

    def __init__(self, target: str):
        self.target = target
        self.root = os.geteuid() == 0

    def __enter__(self):
        if self.root:
            if not shutil.which("chattr"):
                pytest.skip("running as root without chattr: cannot make a read-only location")
            r = subprocess.run(["chattr", "+i", self.target], capture_output=True)
            if r.returncode:
                pytest.skip(f"chattr +i unsupported here: {r.stderr.decode().strip()}")
        else:
            self.mode = os.stat(self.target).st_mode
            os.chmod(self.target, 0o555 if os.path.isdir(self.target) else 0o444)
        return self

    def __exit__(self, *exc):
        if self.root:
            subprocess.run(["chattr", "-i", self.target], check=True)
        else:
            os.chmod(self.target, self.mode)


def test_create_in_read_only_directory(tmp_path):
    with ReadOnly(str(tmp_path)):
        raises_one_line(ReadOnlyLocationError, EventLog.create, str(tmp_path / "events.db"))
    assert not (tmp_path / "events.db").exists()


def test_open_writer_in_read_only_directory_but_readers_work(path, tmp_path):
    make_log(path, 3)
    os.unlink(path + ".lock")  # so the lock file would have to be created, too
    with ReadOnly(str(tmp_path)):
        raises_one_line(ReadOnlyLocationError, EventLog.open, path)
        with EventLog.open_reader(path) as reader:
            assert [r.data["i"] for r in reader.read()] == [0, 1, 2]
            assert reader.verify().ok


def test_open_writer_on_read_only_file(path):
    make_log(path, 3)
    with ReadOnly(path):
        raises_one_line(ReadOnlyLocationError, EventLog.open, path)
        with EventLog.open_reader(path) as reader:
            assert reader.last_seq == 3


def test_leftovers_of_a_killed_create_are_cleaned_by_the_next_writer(path):
    make_log(path, 1)
    stale = f"{path}.creating-999999"
    for name in (stale, stale + "-journal"):
        with open(name, "wb") as f:
            f.write(b"half-built")
    with EventLog.open(path) as lg:
        assert lg.last_seq == 1
    assert not os.path.exists(stale) and not os.path.exists(stale + "-journal")


def test_a_commit_blocked_past_the_busy_timeout_is_a_one_line_storage_error_and_stores_nothing(tmp_path, monkeypatch):
    import eventlog.log

    monkeypatch.setattr(eventlog.log, "_BUSY_TIMEOUT_S", 0.1)
    path = str(tmp_path / "e.db")
    log = EventLog.create(path)
    log.append("a", {"i": 1})
    log.commit()
    intruder = sqlite3.connect(path, isolation_level=None)
    intruder.execute("BEGIN IMMEDIATE")  # holds the write lock, as a foreign connection could
    log.append("a", {"i": 2})
    err = raises_one_line(StorageError, log.commit)
    assert "busy timeout" in str(err)
    intruder.execute("ROLLBACK")
    intruder.close()
    assert log.next_seq == 2  # nothing of the failed commit was stored; the log goes on
    log.append("a", {"i": 3})
    assert log.commit() == 2
    assert [r.data for r in log.read()] == [{"i": 1}, {"i": 3}]
    log.close()


@pytest.mark.parametrize("code, words", [(13, "disk or quota is full"), (10, "I/O error"), (5, "busy timeout")])
def test_storage_failures_translate_to_one_line_errors(code, words):
    from eventlog.fileformat import translate

    exc = sqlite3.OperationalError("database or disk is full")
    exc.sqlite_errorcode = code
    err = translate(exc, "/x/events.db")
    assert isinstance(err, StorageError) and words in str(err) and "\n" not in str(err)

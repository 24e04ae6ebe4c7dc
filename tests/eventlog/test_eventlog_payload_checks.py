"""Every byte the log reads back is checked: a payload in its row against its checksum, a log a full
disk interrupted read whole (the WAL holds what the main file lacks), a full disk at creation one
line that leaves nothing behind (docs/log-format.md)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import sqlite3

import pytest

from eventlog import CorruptLogError, EventLog, StorageError
from eventlog.fileformat import PAGE_SIZE
from eventlog.lock import lock_path_for
from tests.support.disk import fill, tmpfs

PAYLOAD_BYTES = 36 * 1024  # a 4,000-token trace: in its row, not in a side file


def _log_of_long_payloads(path: str, traces: int = 40, seed: int = 0) -> dict[int, bytes]:
    rng = random.Random(seed)
    payloads = {}
    with EventLog.create(path) as log:
        for i in range(traces):
            log.append("tick", {"i": i})
            payload = rng.randbytes(PAYLOAD_BYTES)
            payloads[log.append("trace", {"i": i}, payload=payload)] = payload
            log.commit()
    return payloads  # closed: checkpointed, the file holds everything


def test_a_changed_payload_byte_is_named_on_every_read(path):
    payloads = _log_of_long_payloads(path)
    seq = sorted(payloads)[7]
    with open(path, "r+b") as f:
        data = f.read()
        at = data.index(payloads[seq][5000:5064])
        f.seek(at)
        f.write(bytes(1024))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"  # SQLite does not see it
    conn.close()
    line = rf"events\.db is damaged: seq {seq}: its data or payload fails its checksum"
    with EventLog.open_reader(path) as log:
        with pytest.raises(CorruptLogError, match=line):
            log.read_payloads([seq])
        with pytest.raises(CorruptLogError, match=line):
            list(log.read_rows())
        assert list(log.damaged_rows()) == [seq]
        assert log.read_payloads([seq + 2]) == {seq + 2: payloads[seq + 2]}  # the others read
        report = log.verify()
        assert not report.ok and f"seq {seq}: its data or payload fails its checksum" in report.problems[0]


@pytest.mark.parametrize("seed", range(10))
def test_4_kib_at_a_random_offset_of_a_log_of_long_payloads_never_passes_unseen(tmp_path, seed):
    """The trial that found payload damage appended onto: each 4 KiB overwrite is refused by the
    writer's open (SQLite's quick_check), or named by the payload checksums, or changed nothing."""
    pristine = str(tmp_path / "pristine.db")
    payloads = _log_of_long_payloads(pristine, seed=seed)
    path = str(tmp_path / "events.db")
    shutil.copy(pristine, path)
    size = os.path.getsize(path)
    offset = random.Random(seed).randrange(PAGE_SIZE, size - 4096)  # past page 1 (the header)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(random.Random(-seed).randbytes(4096))
    try:
        log = EventLog.open(path)
    except CorruptLogError:
        return  # refused before anything was written
    with log:
        damaged = log.damaged_rows()
        if damaged:
            return
        rows = list(log.read_rows())
    with EventLog.open_reader(pristine) as intact:
        assert rows == list(intact.read_rows()), f"damage at offset {offset} passed unseen"
    assert {seq: payload for seq, _ts, kind, _data, payload in rows if kind == "trace"} == payloads


def _as_format_2(path: str) -> None:
    """A log as the format 2 code wrote it: no payload_hash column."""
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE events DROP COLUMN row_hash")
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    conn.commit()
    conn.close()


def test_a_format_2_log_is_read_and_appended_to_unchecked(path):
    payloads = _log_of_long_payloads(path, traces=3)
    _as_format_2(path)
    with EventLog.open_reader(path) as log:
        assert log.format_version == 2 and not log.row_hashes
        assert log.read_payloads(payloads) == payloads and log.damaged_rows() == {}
    with EventLog.open(path) as log:
        seq = log.append("trace", {}, payload=b"\x01\x02")
        log.commit()
        assert log.read_payloads([seq]) == {seq: b"\x01\x02"}
        assert log.meta["format_version"] == "2" and log.verify().ok


def test_a_rebuilt_log_keeps_its_format_and_checksums(path):
    payloads = _log_of_long_payloads(path, traces=3)
    with EventLog.open(path) as log:
        log.save_snapshot(log.last_seq, "r1", b"state")
    conn = sqlite3.connect(path)
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'snapshots'").fetchone()[0]
    conn.close()
    with open(path, "r+b") as f:  # the snapshots table's root page: a damaged b-tree
        f.seek((root - 1) * PAGE_SIZE)
        f.write(b"\xa5" * 64)
    with EventLog.open(path) as log:
        assert log.damaged_copy is not None and log.format_version == 3
        assert log.read_payloads(payloads) == payloads and log.damaged_rows() == {}


# ---------------------------------------------------------------- a full disk


def _copy_of_a_live_log(path: str, copy: str, events: int = 200) -> None:
    """A copy of a log whose last commits are only in its WAL (the writer is open, no checkpoint
    has run), as a full disk that stopped a checkpoint leaves it."""
    with EventLog.create(path) as log:
        for i in range(events):
            log.append("tick", {"i": i, "pad": "x" * 500})
            if i % 20 == 19:
                log.commit()
        log.commit()
        for suffix in ("", "-wal"):
            shutil.copy(path + suffix, copy + suffix)


def test_a_checkpoint_a_full_disk_cut_short_resumes(tmp_path):
    path, copy = str(tmp_path / "live.db"), str(tmp_path / "events.db")
    _copy_of_a_live_log(path, copy)
    whole = os.path.getsize(copy)
    with open(path, "rb") as f:  # the checkpoint wrote part of the next page, then the disk was full
        f.seek(whole)
        part = f.read(PAGE_SIZE // 3)
    with open(copy, "ab") as f:
        f.write(part or b"\0" * (PAGE_SIZE // 3))
    assert os.path.getsize(copy) % PAGE_SIZE
    with EventLog.open_reader(copy) as log:
        assert log.last_seq == 200 and log.verify().ok
    with EventLog.open(copy) as log:
        log.append("tick", {"i": 200})
        log.commit()
    with EventLog.open_reader(copy) as log:
        assert [r.data["i"] for r in log.read()] == list(range(201))
    assert os.path.getsize(copy) % PAGE_SIZE == 0


@pytest.mark.parametrize("cut", ["part page", "a page the WAL lacks"])
def test_a_log_really_cut_short_is_still_refused(tmp_path, cut):
    path, copy = str(tmp_path / "live.db"), str(tmp_path / "events.db")
    _copy_of_a_live_log(path, copy)
    if cut == "part page":
        os.unlink(copy + "-wal")  # nothing supplies the partial page
        with open(copy, "ab") as f:
            f.write(b"\0" * 1000)
        fragment = "not a whole number of pages"
    else:
        conn = sqlite3.connect(copy)  # everything into the main file, the WAL emptied
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        os.truncate(copy, os.path.getsize(copy) - PAGE_SIZE)
        fragment = "pages present"
    for opener in (EventLog.open, EventLog.open_reader):
        with pytest.raises(CorruptLogError, match=fragment):
            opener(copy)


@pytest.fixture
def small_tmpfs(tmp_path):
    with tmpfs(tmp_path, "1m") as mount:
        yield mount


@pytest.mark.parametrize("leave", [0, 2048, 4096, 8192, 16384, 32768, 65536])
def test_a_full_disk_at_creation_is_one_line_and_leaves_nothing_behind(small_tmpfs, leave):
    path = str(small_tmpfs / "events.db")
    meta = {"config": "c" * 30000}  # a config bigger than a page
    filler = fill(small_tmpfs, leave)
    try:
        EventLog.create(path, meta=meta).close()
    except StorageError as err:
        assert "\n" not in str(err) and "full" in str(err) or "No space" in str(err), str(err)
        assert sorted(os.listdir(small_tmpfs)) == ["filler"], "a failed creation leaves nothing"
    else:
        assert os.path.exists(path)
        return
    os.unlink(filler)
    EventLog.create(path, meta=meta).close()  # the next try, once space is free
    with EventLog.open_reader(path) as log:
        assert log.meta["config"] == meta["config"]


# Each write point of a creation, and the os functions the stand-in makes fail there (a link
# refused falls back to a rename, which fails too on a full disk).
_WRITE_POINTS = {
    "lock file": ("open",),
    "lock owner": ("pwrite",),
    "lock size": ("ftruncate",),
    "link": ("link", "rename"),
    "fsync": ("fsync",),
}


@pytest.mark.parametrize("point", _WRITE_POINTS)
def test_enospc_at_each_write_point_of_creation_is_one_line_and_leaves_nothing(path, monkeypatch, point):
    """The same, everywhere, with a stand-in: each write of a creation fails in turn with ENOSPC
    (the database's own writes are SQLite's: the tmpfs test above fills those)."""
    lock = lock_path_for(path)

    def failing(real):
        def full(*args, **kwargs):
            if real is os.open and args[0] != lock:
                return real(*args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return full

    for name in _WRITE_POINTS[point]:
        monkeypatch.setattr(os, name, failing(getattr(os, name)))
    with pytest.raises(StorageError, match="No space left on device") as refused:
        EventLog.create(path).close()
    assert "\n" not in str(refused.value)
    monkeypatch.undo()
    assert os.listdir(os.path.dirname(path)) == [], "a failed creation leaves nothing"
    EventLog.create(path).close()

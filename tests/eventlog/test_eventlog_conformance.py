"""Conformance of EventLog to its contract: order, contiguity, atomicity, readers, snapshots."""

from __future__ import annotations

import hashlib
import sqlite3
import threading

import orjson
import pytest

from eventlog import (
    CorruptLogError,
    EventLog,
    InvalidArgumentError,
    InvalidEventError,
    LogClosedError,
    LogError,
    NotWriterError,
    Record,
    Snapshot,
    canonical_json,
)


def add_failing_trigger(path: str) -> None:
    """Make any insert of kind 'boom' fail inside SQLite (a real mid-batch failure)."""
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TRIGGER boom BEFORE INSERT ON events WHEN NEW.kind = 'boom'"
            " BEGIN SELECT RAISE(ABORT, 'boom refused'); END"
        )
    db.close()


def seqs(lg: EventLog) -> list[int]:
    return [r.seq for r in lg.read()]


# ---------------------------------------------------------------- create / meta


def test_create_writes_schema_and_meta(log, path):
    assert log.meta["magic"] == "orch-eventlog"
    assert log.meta["format_version"] == "1"
    assert log.meta["seed"] == "1"
    assert (log.last_seq, log.next_seq) == (0, 1)
    with sqlite3.connect(path) as db:
        tables = dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type='table'"))
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    assert set(tables) == {"events", "meta", "snapshots"}
    assert "seq INTEGER PRIMARY KEY" in tables["events"] and "data TEXT NOT NULL" in tables["events"]


def test_synchronous_follows_durability(path):
    for durability, level in (("full", 2), ("normal", 1)):
        p = f"{path}.{durability}"
        with EventLog.create(p, durability=durability) as lg:
            assert lg._conn.execute("PRAGMA synchronous").fetchone()[0] == level


@pytest.mark.parametrize("bad", ["FULL", "off", "", None, 2])
def test_unknown_durability_is_an_error(path, bad):
    with pytest.raises(InvalidArgumentError):
        EventLog.create(path, durability=bad)


def test_set_meta_and_reserved_keys(log, path):
    log.set_meta("config", '{"a": 1}')
    assert EventLog.open_reader(path).meta["config"] == '{"a": 1}'
    for key in ("magic", "format_version"):
        with pytest.raises(InvalidArgumentError):
            log.set_meta(key, "x")
    with pytest.raises(InvalidArgumentError):
        log.set_meta("seed", 1)


def test_create_rejects_reserved_or_non_str_meta(tmp_path):
    with pytest.raises(InvalidArgumentError):
        EventLog.create(str(tmp_path / "a.db"), meta={"format_version": "9"})
    with pytest.raises(InvalidArgumentError):
        EventLog.create(str(tmp_path / "b.db"), meta={"seed": 1})
    assert not (tmp_path / "a.db").exists() and not (tmp_path / "b.db").exists()


# ---------------------------------------------------------------- append / commit


def test_seqs_are_assigned_at_append_and_contiguous(log):
    assert [log.append("k", {"i": i}) for i in range(5)] == [1, 2, 3, 4, 5]
    assert (log.last_seq, log.next_seq, log.pending) == (0, 6, 5)
    assert log.commit() == 5
    assert log.append_json("j", b'{"i":5}') == 6
    assert log.commit() == 6
    assert [(r.seq, r.kind, r.data) for r in log.read()] == [
        *[(i + 1, "k", {"i": i}) for i in range(5)],
        (6, "j", {"i": 5}),
    ]


def test_order_and_payloads_round_trip(log):
    payloads = [None, 0, -1.5, "s", [1, [2, None]], {"z": 1, "a": {"b": [True, False]}}, 2**63 - 1]
    for i, p in enumerate(payloads):
        log.append(f"kind{i % 3}", p)
    log.commit()
    got = list(log.read())
    assert [r.data for r in got] == payloads
    assert [r.kind for r in got] == [f"kind{i % 3}" for i in range(len(payloads))]
    assert all(isinstance(r, Record) and isinstance(r.ts, float) for r in got)
    assert [r.ts for r in got] == sorted(r.ts for r in got)


def test_data_is_stored_as_text_json(log, path):
    log.append("k", {"a": [1, 2]})
    log.commit()
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT typeof(data), json_extract(data, '$.a[1]') FROM events").fetchone()
    db.close()
    assert row == ("text", 2)


def test_commit_with_empty_buffer_is_a_noop(log):
    assert log.commit() == 0
    log.append("k", 1)
    log.commit()
    assert log.commit() == 1


def test_discard_rolls_back_the_counter(log):
    log.append("k", 1)
    log.commit()
    log.append("k", 2)
    log.append("k", 3)
    log.discard()
    assert (log.next_seq, log.pending) == (2, 0)
    assert log.append("k", 4) == 2
    log.commit()
    assert [r.data for r in log.read()] == [1, 4]


@pytest.mark.parametrize(
    "bad",
    [
        float("nan"),
        {"x": float("inf")},
        {"x": [1.0, None, -float("inf")]},
        {"null": [{"y": float("nan")}]},
        {1: "non-str key"},
        {"s": {1, 2}},
        {"b": b"bytes"},
        {"o": object()},
        2**64,
    ],
)
def test_append_rejects_non_json(log, bad):
    log.append("k", 1)
    with pytest.raises(InvalidEventError):
        log.append("k", bad)
    assert (log.next_seq, log.pending) == (2, 1)  # the rejected event took no seq
    assert log.commit() == 1


@pytest.mark.parametrize("kind", ["", None, 3, b"k"])
def test_append_rejects_bad_kind(log, kind):
    with pytest.raises(InvalidEventError):
        log.append(kind, {})
    with pytest.raises(InvalidEventError):
        log.append_json(kind, b"{}")


def test_append_json_stores_bytes_verbatim(log):
    log.append_json("k", orjson.dumps({"b": 2, "a": 1}))
    log.append_json("k", '{"s": "str is fine too"}')
    log.commit()
    assert [raw[3] for raw in log.read_raw()] == [b'{"b":2,"a":1}', b'{"s": "str is fine too"}']
    with pytest.raises(InvalidEventError):
        log.append_json("k", b"\xff\xfe")


@pytest.mark.parametrize("text", ['{"q":"a \\"quoted\\" \\\\ back\\/slash"}', '{"u":"\\u0000\\u001f\\ud83d\\ude00"}',
                                  '{"x":"é ü 中文 😀","n":1.0e-7,"i":-0}', ' [1, 2.50, "  spaced  "] ', '"\\t"'])
def test_group_insert_keeps_every_byte_of_the_json(log, text):
    seq = log.append_json("kind with spaces ☃", text)
    log.append_json("k", text)
    log.commit()
    assert [(kind, data) for _s, _t, kind, data in log.read_raw(seq)] == [
        ("kind with spaces ☃", text.encode()), ("k", text.encode())]


def test_failing_batch_stores_nothing_and_next_commit_continues(log, path):
    log.append("ok", 0)
    log.commit()
    add_failing_trigger(path)
    for i in range(3):
        log.append("ok", i + 1)
    log.append("boom", 99)  # fails in the middle of the batch
    log.append("ok", 5)
    with pytest.raises(LogError, match="boom refused") as refused:  # typed, the driver's error chained
        log.commit()
    assert isinstance(refused.value.__cause__, sqlite3.IntegrityError)
    assert (log.last_seq, log.next_seq, log.pending) == (1, 2, 0)
    assert seqs(EventLog.open_reader(path)) == [1]
    assert log.append("ok", "after") == 2
    assert log.commit() == 2
    assert [(r.seq, r.data) for r in log.read()] == [(1, 0), (2, "after")]
    assert log.verify().ok


def test_context_manager_commits_on_success_and_discards_on_error(path):
    with EventLog.create(path) as lg:
        lg.append("k", 1)
    with pytest.raises(RuntimeError):
        with EventLog.open(path) as lg:
            lg.append("k", 2)
            raise RuntimeError
    with EventLog.open(path) as lg:
        assert [r.data for r in lg.read()] == [1]


def test_close_discards_with_a_warning_and_closes(path):
    lg = EventLog.create(path)
    lg.append("k", 1)
    with pytest.warns(RuntimeWarning, match="uncommitted"):
        lg.close()
    lg.close()  # idempotent
    with pytest.raises(LogClosedError):
        lg.append("k", 1)
    with pytest.raises(LogClosedError):
        list(lg.read())
    assert EventLog.open_reader(path).last_seq == 0


def test_reopen_continues_the_sequence(path):
    with EventLog.create(path) as lg:
        lg.append("k", 1)
        lg.append("k", 2)
    with EventLog.open(path) as lg:
        assert (lg.last_seq, lg.next_seq) == (2, 3)
        assert lg.append("k", 3) == 3
    assert seqs(EventLog.open_reader(path)) == [1, 2, 3]


# ---------------------------------------------------------------- reading


@pytest.fixture
def filled(log):
    for i in range(1, 101):
        log.append("even" if i % 2 == 0 else "odd", {"i": i})
    log.commit()
    return log


@pytest.mark.parametrize("chunk", [1, 7, 100, 4096])
def test_read_ranges_and_chunks(filled, chunk):
    assert seqs_of(filled.read(chunk_size=chunk)) == list(range(1, 101))
    assert seqs_of(filled.read(10, 20, chunk_size=chunk)) == list(range(10, 21))
    assert seqs_of(filled.read(0, 3, chunk_size=chunk)) == [1, 2, 3]
    assert seqs_of(filled.read(95, 1000, chunk_size=chunk)) == list(range(95, 101))
    assert seqs_of(filled.read(50, 40, chunk_size=chunk)) == []
    assert seqs_of(filled.read(kinds=["even"], chunk_size=chunk)) == list(range(2, 101, 2))
    assert seqs_of(filled.read(11, 15, kinds="odd", chunk_size=chunk)) == [11, 13, 15]
    assert seqs_of(filled.read(kinds=[], chunk_size=chunk)) == []


def seqs_of(records) -> list[int]:
    return [r[0] for r in records]


def test_read_raw_returns_undecoded_bytes(filled):
    raw = list(filled.read_raw(1, 2))
    assert raw[0][0] == 1 and raw[0][2] == "odd" and raw[0][3] == b'{"i":1}'
    assert isinstance(raw[1][3], bytes)


@pytest.mark.parametrize("chunk", [1, 7, 100, 4096])
def test_read_bodies_yields_kind_and_bytes_of_each_seq_in_order(filled, chunk):
    bodies = list(filled.read_bodies(chunk_size=chunk))
    assert bodies == [(kind, data) for _seq, _ts, kind, data in filled.read_raw()]
    assert len(bodies) == 100 and bodies[0] == ("odd", b'{"i":1}')
    assert list(filled.read_bodies(10, 12, chunk_size=chunk)) == bodies[9:12]
    assert list(filled.read_bodies(0, 2, chunk_size=chunk)) == bodies[:2]
    assert list(filled.read_bodies(99, 1000, chunk_size=chunk)) == bodies[98:]
    assert list(filled.read_bodies(50, 40, chunk_size=chunk)) == []


def test_read_bodies_refuses_a_gap(filled, path):
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE seq = 40")
    db.close()
    reader = EventLog.open_reader(path)
    assert len(list(reader.read_bodies(41))) == 60  # after the gap: still contiguous
    with pytest.raises(CorruptLogError, match="not contiguous"):
        list(reader.read_bodies(chunk_size=16))
    reader.close()


def test_read_does_not_see_uncommitted_appends(filled):
    filled.append("k", "pending")
    assert seqs_of(filled.read())[-1] == 100


def test_reader_sees_new_commits_and_cannot_write(log, path):
    reader = EventLog.open_reader(path)
    assert reader.last_seq == 0 and not reader.is_writer
    log.append("k", 1)
    log.commit()
    assert reader.last_seq == 1 and reader.next_seq == 2
    assert [r.data for r in reader.read()] == [1]
    for write in (lambda: reader.append("k", 1), lambda: reader.append_json("k", b"1"),
                  reader.commit, reader.discard, lambda: reader.set_meta("a", "b"),
                  lambda: reader.save_snapshot(1, "v", b""), reader.checkpoint):
        with pytest.raises(NotWriterError):
            write()
    reader.close()


def test_reader_never_blocks_on_an_open_write_transaction(filled, path):
    """A writer mid-transaction (holding SQLite's write lock) does not stall readers: a reader that
    waited for the lock would never get it while the transaction stays open, and would fail."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO events VALUES (101, 0, 'uncommitted', '{}')")
    try:
        reader = EventLog.open_reader(path)
        assert reader.last_seq == 100
        assert len(list(reader.read())) == 100
        assert len(list(filled.read())) == 100
        reader.close()
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_reader_concurrent_with_writer(log, path):
    """Every read by a concurrent reader is a contiguous, growing prefix of the log."""
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for b in range(200):
                for i in range(b % 17 + 1):
                    log.append("k", {"b": b, "i": i})
                log.commit()
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    reader = EventLog.open_reader(path)
    writer.start()
    seen = 0
    while not done.is_set() or seen < log.last_seq:
        got = seqs_of(reader.read(chunk_size=64))
        assert got == list(range(1, len(got) + 1))
        assert len(got) >= seen
        seen = len(got)
    writer.join()
    assert not errors
    assert seen == log.last_seq == sum(b % 17 + 1 for b in range(200))
    reader.close()


# ---------------------------------------------------------------- snapshots


def test_snapshot_round_trip(filled):
    h = filled.save_snapshot(50, "r1", b"state-50")
    assert h == hashlib.sha256(b"state-50").hexdigest()
    h80 = filled.save_snapshot(80, "r1", b"state-80")
    assert filled.load_snapshot("r1") == Snapshot(80, "r1", h80, b"state-80")
    assert filled.load_snapshot("r1", max_seq=79).state == b"state-50"
    assert filled.load_snapshot("r1", max_seq=49) is None
    assert filled.load_snapshot("r2") is None


def test_snapshot_with_other_reducer_version_or_bad_hash_is_ignored(filled, path):
    filled.save_snapshot(10, "r1", b"good")
    filled.save_snapshot(20, "r1", b"tampered")
    filled.save_snapshot(30, "r2", b"other reducer")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE snapshots SET state = x'00' WHERE seq = 20")
    db.close()
    snap = filled.load_snapshot("r1")
    assert (snap.seq, snap.state) == (10, b"good")
    reader = EventLog.open_reader(path)
    assert reader.load_snapshot("r1").seq == 10
    assert reader.load_snapshot("r2").seq == 30
    reader.close()


def test_snapshot_must_be_at_a_committed_seq(filled):
    filled.append("k", "pending")
    with pytest.raises(InvalidArgumentError):
        filled.save_snapshot(101, "r1", b"x")
    with pytest.raises(InvalidArgumentError):
        filled.save_snapshot(-1, "r1", b"x")
    assert filled.save_snapshot(0, "r1", b"initial")


# ---------------------------------------------------------------- verify / checkpoint


def test_verify_ok_and_reports_a_gap(filled, path):
    report = filled.verify()
    assert report.ok and report.events == 100 and report.last_seq == 100 and report.format_version == 1
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE seq IN (40, 41)")
    db.close()
    report = EventLog.open_reader(path).verify()
    assert not report.ok
    assert any("gap" in p and "40" in p for p in report.problems)


def test_checkpoint_truncates_the_wal(filled, path):
    import os

    busy, _, _ = filled.checkpoint()
    assert busy == 0
    assert os.path.getsize(path + "-wal") == 0
    assert filled.checkpoint("passive")[0] == 0
    with pytest.raises(InvalidArgumentError):
        filled.checkpoint("bogus")


def test_canonical_json_sorts_keys():
    assert canonical_json({"b": 1, "a": {"d": 2, "c": 3}}) == b'{"a":{"c":3,"d":2},"b":1}'
    with pytest.raises(InvalidEventError):
        canonical_json({"x": float("nan")})

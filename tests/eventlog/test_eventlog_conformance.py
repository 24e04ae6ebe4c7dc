"""Conformance to the recorder contract (eventlog.Recorder): order, contiguity, atomicity, reads,
payloads, snapshots.

The contract's tests take the `recorder` fixture and run over every recorder (conftest.RECORDERS:
EventLog in SQLite, MemoryLog in memory) as one suite; a test of what only the SQLite file has
(its schema, durability, meta, reopening, readers beside the writer, a commit SQLite refuses, a
damaged file, WAL, verify) is marked sqlite_only with the feature the other recorders lack."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import warnings

import orjson
import pytest

from eventlog import (
    CorruptLogError,
    DroppedPayload,
    EventLog,
    InvalidArgumentError,
    InvalidEventError,
    LogClosedError,
    LogError,
    NotWriterError,
    PayloadDroppedError,
    Record,
    Snapshot,
)

pytestmark = pytest.mark.recorder_suite
sqlite_only = pytest.mark.sqlite_only


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


@sqlite_only("a file's schema and meta")
def test_create_writes_schema_and_meta(log, path):
    assert log.meta["magic"] == "orch-eventlog"
    assert log.meta["format_version"] == "3"
    assert log.meta["seed"] == "1"
    assert (log.last_seq, log.next_seq) == (0, 1)
    with sqlite3.connect(path) as db:
        tables = dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type='table'"))
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    assert set(tables) == {"events", "meta", "snapshots"}
    assert "seq INTEGER PRIMARY KEY" in tables["events"] and "data TEXT NOT NULL" in tables["events"]


@sqlite_only("durability")
def test_synchronous_follows_durability(path):
    for durability, level in (("full", 2), ("normal", 1)):
        p = f"{path}.{durability}"
        with EventLog.create(p, durability=durability) as lg:
            assert lg._conn.execute("PRAGMA synchronous").fetchone()[0] == level


@sqlite_only("durability")
@pytest.mark.parametrize("bad", ["FULL", "off", "", None, 2])
def test_unknown_durability_is_an_error(path, bad):
    with pytest.raises(InvalidArgumentError):
        EventLog.create(path, durability=bad)


@sqlite_only("meta")
def test_set_meta_and_reserved_keys(log, path):
    log.set_meta("config", '{"a": 1}')
    assert EventLog.open_reader(path).meta["config"] == '{"a": 1}'
    for key in ("magic", "format_version"):
        with pytest.raises(InvalidArgumentError):
            log.set_meta(key, "x")
    with pytest.raises(InvalidArgumentError):
        log.set_meta("seed", 1)


@sqlite_only("meta")
def test_create_rejects_reserved_or_non_str_meta(tmp_path):
    with pytest.raises(InvalidArgumentError):
        EventLog.create(str(tmp_path / "a.db"), meta={"format_version": "9"})
    with pytest.raises(InvalidArgumentError):
        EventLog.create(str(tmp_path / "b.db"), meta={"seed": 1})
    assert not (tmp_path / "a.db").exists() and not (tmp_path / "b.db").exists()


# ---------------------------------------------------------------- append / commit


def test_seqs_are_assigned_at_append_and_contiguous(recorder):
    assert [recorder.append("k", {"i": i}) for i in range(5)] == [1, 2, 3, 4, 5]
    assert (recorder.last_seq, recorder.next_seq, recorder.pending) == (0, 6, 5)
    assert recorder.commit() == 5
    assert recorder.append_json("j", b'{"i":5}') == 6
    assert recorder.commit() == 6
    assert [(r.seq, r.kind, r.data) for r in recorder.read()] == [
        *[(i + 1, "k", {"i": i}) for i in range(5)],
        (6, "j", {"i": 5}),
    ]


def test_order_and_payloads_round_trip(recorder):
    payloads = [None, 0, -1.5, "s", [1, [2, None]], {"z": 1, "a": {"b": [True, False]}}, 2**63 - 1]
    for i, p in enumerate(payloads):
        recorder.append(f"kind{i % 3}", p)
    recorder.commit()
    got = list(recorder.read())
    assert [r.data for r in got] == payloads
    assert [r.kind for r in got] == [f"kind{i % 3}" for i in range(len(payloads))]
    assert all(isinstance(r, Record) and isinstance(r.ts, float) for r in got)
    assert [r.ts for r in got] == sorted(r.ts for r in got)


@sqlite_only("a file's schema")
def test_data_is_stored_as_text_json(log, path):
    log.append("k", {"a": [1, 2]})
    log.commit()
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT typeof(data), json_extract(data, '$.a[1]') FROM events").fetchone()
    db.close()
    assert row == ("text", 2)


def test_commit_with_empty_buffer_is_a_noop(recorder):
    assert recorder.commit() == 0
    recorder.append("k", 1)
    recorder.commit()
    assert recorder.commit() == 1


def test_discard_rolls_back_the_counter(recorder):
    recorder.append("k", 1)
    recorder.commit()
    recorder.append("k", 2)
    recorder.append("k", 3)
    recorder.discard()
    assert (recorder.next_seq, recorder.pending) == (2, 0)
    assert recorder.append("k", 4) == 2
    recorder.commit()
    assert [r.data for r in recorder.read()] == [1, 4]


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
def test_append_rejects_non_json(recorder, bad):
    recorder.append("k", 1)
    with pytest.raises(InvalidEventError):
        recorder.append("k", bad)
    assert (recorder.next_seq, recorder.pending) == (2, 1)  # the rejected event took no seq
    assert recorder.commit() == 1


@pytest.mark.parametrize("kind", ["", None, 3, b"k"])
def test_append_rejects_bad_kind(recorder, kind):
    with pytest.raises(InvalidEventError):
        recorder.append(kind, {})
    with pytest.raises(InvalidEventError):
        recorder.append_json(kind, b"{}")


def test_append_json_stores_bytes_verbatim(recorder):
    recorder.append_json("k", orjson.dumps({"b": 2, "a": 1}))
    recorder.append_json("k", '{"s": "str is fine too"}')
    recorder.commit()
    assert [raw[3] for raw in recorder.read_raw()] == [b'{"b":2,"a":1}', b'{"s": "str is fine too"}']
    with pytest.raises(InvalidEventError):
        recorder.append_json("k", b"\xff\xfe")


@pytest.mark.parametrize(
    "text",
    [
        '{"q":"a \\"quoted\\" \\\\ back\\/slash"}',
        '{"u":"\\u0000\\u001f\\ud83d\\ude00"}',
        '{"x":"é ü 中文 😀","n":1.0e-7,"i":-0}',
        ' [1, 2.50, "  spaced  "] ',
        '"\\t"',
    ],
)
def test_group_insert_keeps_every_byte_of_the_json(recorder, text):
    seq = recorder.append_json("kind with spaces ☃", text)
    recorder.append_json("k", text)
    recorder.commit()
    assert [(kind, data) for _s, _t, kind, data in recorder.read_raw(seq)] == [
        ("kind with spaces ☃", text.encode()),
        ("k", text.encode()),
    ]


@sqlite_only("a commit SQLite refuses")
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


@sqlite_only("reopening")
def test_context_manager_commits_on_success_and_discards_on_error(path):
    with EventLog.create(path) as lg:
        lg.append("k", 1)
    with pytest.raises(RuntimeError):
        with EventLog.open(path) as lg:
            lg.append("k", 2)
            raise RuntimeError
    with EventLog.open(path) as lg:
        assert [r.data for r in lg.read()] == [1]


@sqlite_only("readers beside the writer")
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


@sqlite_only("reopening")
def test_reopen_continues_the_sequence(path):
    with EventLog.create(path) as lg:
        lg.append("k", 1)
        lg.append("k", 2)
    with EventLog.open(path) as lg:
        assert (lg.last_seq, lg.next_seq) == (2, 3)
        assert lg.append("k", 3) == 3
    assert seqs(EventLog.open_reader(path)) == [1, 2, 3]


def test_a_recorder_as_context_manager_discards_on_error_then_closes(recorder):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # closing with appends left would warn "uncommitted"
        with pytest.raises(RuntimeError):
            with recorder as lg:
                lg.append("k", 1)
                raise RuntimeError
    assert recorder.closed


def test_a_closed_recorder_discards_with_a_warning_and_refuses_everything(recorder):
    recorder.append("k", 1)
    recorder.commit()
    recorder.append("k", 2)
    with pytest.warns(RuntimeWarning, match="uncommitted"):
        recorder.close()
    recorder.close()  # idempotent
    assert recorder.closed
    for use in (
        lambda: recorder.append("k", 1),
        lambda: recorder.append_json("k", b"1"),
        recorder.commit,
        lambda: list(recorder.read()),
        lambda: list(recorder.read_raw()),
        lambda: list(recorder.read_rows()),
        lambda: list(recorder.read_bodies()),
        lambda: recorder.read_payloads([1]),
        lambda: recorder.save_snapshot(1, "r1", b"x"),
        lambda: recorder.load_snapshot("r1"),
    ):
        with pytest.raises(LogClosedError):
            use()


# ---------------------------------------------------------------- reading


def fill(lg):
    for i in range(1, 101):
        lg.append("even" if i % 2 == 0 else "odd", {"i": i})
    lg.commit()
    return lg


@pytest.fixture
def filled(recorder):
    """Either recorder holding seqs 1..100, of kinds odd and even."""
    return fill(recorder)


@pytest.fixture
def filled_log(log):
    """An EventLog holding seqs 1..100, of kinds odd and even."""
    return fill(log)


@pytest.mark.parametrize("read", ["read", "read_raw", "read_rows"])
@pytest.mark.parametrize("chunk", [1, 7, 100, 4096])
def test_read_ranges_and_chunks(filled, read, chunk):
    def seqs_read(*args, **kwargs) -> list[int]:
        return seqs_of(getattr(filled, read)(*args, chunk_size=chunk, **kwargs))

    assert seqs_read() == list(range(1, 101))
    assert seqs_read(10, 20) == list(range(10, 21))
    assert seqs_read(0, 3) == [1, 2, 3]
    assert seqs_read(95, 1000) == list(range(95, 101))
    assert seqs_read(50, 40) == []
    assert seqs_read(kinds=["even"]) == list(range(2, 101, 2))
    assert seqs_read(11, 15, kinds="odd") == [11, 13, 15]
    assert seqs_read(kinds=[]) == []


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


@sqlite_only("a damaged file (a missing row)")
@pytest.mark.parametrize("read", ["read", "read_raw", "read_rows", "read_bodies"])
def test_every_read_in_seq_order_refuses_a_gap(filled_log, path, read):
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE seq = 40")
    db.close()
    reader = EventLog.open_reader(path)
    read_from = getattr(reader, read)
    assert len(list(read_from(41))) == 60  # after the gap: still contiguous
    with pytest.raises(CorruptLogError, match="seqs 33..48 are not contiguous"):
        list(read_from(chunk_size=16))
    with pytest.raises(CorruptLogError, match="seqs 1..40 are not contiguous"):
        list(read_from(1, 40))  # the gap at the range's end: short of what it asked for
    with pytest.raises(CorruptLogError, match="seqs 40..40 are missing"):
        list(read_from(40, 40))
    if read != "read_bodies":  # a read of some kinds expects no seq: nothing to check
        assert len(list(read_from(kinds=["even"]))) == 49
    reader.close()


@pytest.mark.parametrize("read", ["read", "read_raw", "read_rows", "read_bodies"])
def test_a_chunk_size_below_one_is_refused(filled, read):
    with pytest.raises(InvalidArgumentError):
        list(getattr(filled, read)(chunk_size=0))


def test_read_does_not_see_uncommitted_appends(filled):
    filled.append("k", "pending")
    assert seqs_of(filled.read())[-1] == 100


def test_payloads_round_trip_through_read_rows_and_read_payloads(recorder):
    payloads = {1: b"\x00\x01", 3: b"", 4: bytes(range(256)) * 4}
    recorder.append("trace", {"i": 1}, payload=bytearray(payloads[1]))  # bytes-like: stored as bytes
    recorder.append("note", {"i": 2})
    recorder.append_json("trace", b'{"i":3}', payload=payloads[3])
    recorder.append_json("trace", b'{"i":4}', payload=memoryview(payloads[4]))
    recorder.commit()
    recorder.append("trace", {"i": 5}, payload=b"uncommitted")
    rows = list(recorder.read_rows())
    assert [(seq, kind, data, payload) for seq, _ts, kind, data, payload in rows] == [
        (1, "trace", b'{"i":1}', payloads[1]),
        (2, "note", b'{"i":2}', None),
        (3, "trace", b'{"i":3}', payloads[3]),
        (4, "trace", b'{"i":4}', payloads[4]),
    ]
    assert all(type(row[4]) is bytes for row in rows if row[4] is not None)
    assert [row[0] for row in recorder.read_rows(kinds="trace", chunk_size=1)] == [1, 3, 4]
    # By seq: those with a payload; a seq without one, uncommitted or never given is left out.
    assert recorder.read_payloads([4, 2, 1, 3, 5, 0, 99]) == payloads
    assert recorder.read_payloads([]) == {}


def test_a_dropped_payload_keeps_its_sha256_and_its_read_refuses_in_one_line(recorder):
    kept, gone = b"\x01" * 40, bytes(range(256))
    recorder.append("trace", {"i": 1}, payload=gone)
    recorder.append("note", {"i": 2})
    recorder.append("trace", {"i": 3}, payload=kept)
    recorder.commit()
    # A row without a payload, one uncommitted or never logged, is left as it is.
    assert recorder.drop_payloads([1, 2, 99, 0]) == [1]
    assert recorder.drop_payloads([1]) == []  # dropped once
    assert recorder.read_payloads([3]) == {3: kept}
    sha = hashlib.sha256(gone).hexdigest()
    for read in (lambda: recorder.read_payloads([1, 3]), lambda: list(recorder.read_rows())):
        with pytest.raises(PayloadDroppedError, match=f"seq 1: its payload was dropped .*its sha256 {sha} is kept"):
            read()
    assert [row[4] for row in recorder.read_rows(dropped_as_sha256=True)] == [DroppedPayload(sha), None, kept]
    # The data is all there: the reads of the data alone never look at a payload.
    assert [r.data for r in recorder.read()] == [{"i": 1}, {"i": 2}, {"i": 3}]
    assert [kind for kind, _data in recorder.read_bodies()] == ["trace", "note", "trace"]


@pytest.mark.parametrize("payload", ["text", 3, {"a": 1}])
def test_a_payload_that_is_not_bytes_is_refused_and_takes_no_seq(recorder, payload):
    with pytest.raises(InvalidEventError, match="payload must be bytes"):
        recorder.append("trace", {}, payload=payload)
    assert (recorder.next_seq, recorder.pending) == (1, 0)


@sqlite_only("readers beside the writer")
def test_reader_sees_new_commits_and_cannot_write(log, path):
    reader = EventLog.open_reader(path)
    assert reader.last_seq == 0 and not reader.is_writer
    log.append("k", 1)
    log.commit()
    assert reader.last_seq == 1 and reader.next_seq == 2
    assert [r.data for r in reader.read()] == [1]
    for write in (
        lambda: reader.append("k", 1),
        lambda: reader.append_json("k", b"1"),
        reader.commit,
        reader.discard,
        lambda: reader.set_meta("a", "b"),
        lambda: reader.save_snapshot(1, "v", b""),
        reader.checkpoint,
    ):
        with pytest.raises(NotWriterError):
            write()
    reader.close()


@sqlite_only("readers beside the writer")
def test_reader_never_blocks_on_an_open_write_transaction(filled_log, path):
    """A writer mid-transaction (holding SQLite's write lock) does not stall readers: a reader that
    waited for the lock would never get it while the transaction stays open, and would fail."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO events VALUES (101, 0, 'uncommitted', '{}', NULL, NULL, NULL)")
    try:
        reader = EventLog.open_reader(path)
        assert reader.last_seq == 100
        assert len(list(reader.read())) == 100
        assert len(list(filled_log.read())) == 100
        reader.close()
    finally:
        other.execute("ROLLBACK")
        other.close()


@sqlite_only("readers beside the writer")
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


@sqlite_only("a damaged file (a tampered snapshot)")
def test_snapshot_with_other_reducer_version_or_bad_hash_is_ignored(filled_log, path):
    filled_log.save_snapshot(10, "r1", b"good")
    filled_log.save_snapshot(20, "r1", b"tampered")
    filled_log.save_snapshot(30, "r2", b"other reducer")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE snapshots SET state = x'00' WHERE seq = 20")
    db.close()
    snap = filled_log.load_snapshot("r1")
    assert (snap.seq, snap.state) == (10, b"good")
    reader = EventLog.open_reader(path)
    assert reader.load_snapshot("r1").seq == 10
    assert reader.load_snapshot("r2").seq == 30
    reader.close()


def test_snapshot_of_another_reducer_version_is_not_loaded_and_a_later_save_replaces(filled):
    filled.save_snapshot(10, "r1", b"first")
    filled.save_snapshot(20, "r2", b"other reducer")
    filled.save_snapshot(10, "r1", b"second")
    assert filled.load_snapshot("r1").state == b"second"
    assert filled.load_snapshot("r2", max_seq=19) is None


def test_snapshot_must_be_at_a_committed_seq(filled):
    filled.append("k", "pending")
    with pytest.raises(InvalidArgumentError):
        filled.save_snapshot(101, "r1", b"x")
    with pytest.raises(InvalidArgumentError):
        filled.save_snapshot(-1, "r1", b"x")
    assert filled.save_snapshot(0, "r1", b"initial")


# ---------------------------------------------------------------- verify / checkpoint


@sqlite_only("verify")
def test_verify_ok_and_reports_a_gap(filled_log, path):
    report = filled_log.verify()
    assert report.ok and report.events == 100 and report.last_seq == 100 and report.format_version == 3
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE seq IN (40, 41)")
    db.close()
    report = EventLog.open_reader(path).verify()
    assert not report.ok
    assert any("gap" in p and "40" in p for p in report.problems)


@sqlite_only("a WAL")
def test_checkpoint_truncates_the_wal(filled_log, path):
    import os

    busy, _, _ = filled_log.checkpoint()
    assert busy == 0
    assert os.path.getsize(path + "-wal") == 0
    assert filled_log.checkpoint("passive")[0] == 0
    with pytest.raises(InvalidArgumentError):
        filled_log.checkpoint("bogus")

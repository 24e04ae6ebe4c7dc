"""Model-based test: random append/commit/discard/failing-commit/reopen sequences
against a list model of what must be stored."""

from __future__ import annotations

import os
import sqlite3
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from eventlog import EventLog, LogError

payloads = st.one_of(
    st.integers(-5, 5),
    st.text(max_size=4),
    st.lists(st.integers(0, 9), max_size=4),
    st.dictionaries(st.sampled_from("abc"), st.integers(0, 3) | st.none(), max_size=3),
)


class LogMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "events.db")
        self.log = EventLog.create(self.path)
        with sqlite3.connect(self.path) as db:  # kind 'boom' fails inside SQLite
            db.execute(
                "CREATE TRIGGER boom BEFORE INSERT ON events WHEN NEW.kind = 'boom'"
                " BEGIN SELECT RAISE(ABORT, 'boom'); END"
            )
        db.close()
        self.committed: list[tuple[str, object]] = []
        self.pending: list[tuple[str, object]] = []

    @rule(kind=st.sampled_from(["a", "b"]), data=payloads)
    def append(self, kind, data):
        assert self.log.append(kind, data) == len(self.committed) + len(self.pending) + 1
        self.pending.append((kind, data))

    @rule(data=payloads)
    def append_json(self, data):
        import orjson

        assert self.log.append_json("j", orjson.dumps(data)) == len(self.committed) + len(self.pending) + 1
        self.pending.append(("j", data))

    @rule()
    def commit(self):
        assert self.log.commit() == len(self.committed) + len(self.pending)
        self.committed += self.pending
        self.pending = []

    @rule()
    def failing_commit(self):
        self.log.append("boom", 0)
        try:
            self.log.commit()
        except LogError as err:  # typed, SQLite's refusal chained
            assert isinstance(err.__cause__, sqlite3.IntegrityError)
        else:
            raise AssertionError("commit of a 'boom' batch succeeded")
        self.pending = []  # the whole batch is gone

    @rule()
    def discard(self):
        self.log.discard()
        self.pending = []

    @precondition(lambda self: not self.pending)
    @rule()
    def reopen(self):
        self.log.close()
        self.log = EventLog.open(self.path)

    @invariant()
    def counters_match(self):
        assert self.log.last_seq == len(self.committed)
        assert self.log.next_seq == len(self.committed) + len(self.pending) + 1

    def teardown(self):
        try:
            stored = [(r.kind, r.data) for r in self.log.read()]
            assert [r.seq for r in self.log.read()] == list(range(1, len(stored) + 1))
            assert stored == self.committed
            assert self.log.verify().ok
        finally:
            self.log.discard()
            self.log.close()
            self.dir.cleanup()


TestLogModel = LogMachine.TestCase
TestLogModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)

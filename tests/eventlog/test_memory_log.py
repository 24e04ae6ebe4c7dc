"""The in-memory stand-in (benchmarks' baseline) keeps the writer contract the loop relies on."""

from __future__ import annotations

import pytest

from eventlog.memory import MemoryLog


def test_memory_log_seals_and_commits_in_order():
    log = MemoryLog()
    assert [log.append_json("k", b"1"), log.append_json("k", b"2")] == [1, 2]
    sealed = log.seal()
    assert log.append_json("k", b"3") == 3 and log.next_seq == 4
    with pytest.raises(ValueError):
        log.commit_sealed(log.seal())  # seq 3 before 1..2
    assert log.commit_sealed(sealed) == 2
    assert [(kind, data) for kind, data in log.read_bodies()] == [("k", b"1"), ("k", b"2")]
    log.close()
    assert log.next_seq == 3

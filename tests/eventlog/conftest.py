"""Shared fixtures for the eventlog tests, and the recorders the conformance suite runs over."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventlog import EventLog
from eventlog.memory import MemoryLog

# Every implementation of eventlog.Recorder, by name: the conformance suite runs over each.
RECORDERS = {
    "EventLog": lambda path: EventLog.create(path, meta={"seed": "1"}),
    "MemoryLog": lambda path: MemoryLog(),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "recorder_suite: a module of the recorder contract's tests: each takes the `recorder` fixture "
        "(run over every recorder) or is marked sqlite_only",
    )
    config.addinivalue_line(
        "markers", "sqlite_only(feature): tests what only EventLog's file has (MemoryLog lacks `feature`)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`recorder` runs over every recorder, or over EventLog alone for a test marked sqlite_only;
    in a recorder_suite module, a test that takes no `recorder` must say which feature the other
    recorders lack."""
    sqlite_only = metafunc.definition.get_closest_marker("sqlite_only")
    if "recorder" in metafunc.fixturenames:
        metafunc.parametrize("recorder", ["EventLog"] if sqlite_only else list(RECORDERS), indirect=True)
    elif metafunc.definition.get_closest_marker("recorder_suite") and sqlite_only is None:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: a conformance test takes `recorder` (every recorder runs it) "
            "or is marked sqlite_only(feature) naming what the other recorders lack"
        )


@pytest.fixture
def path(tmp_path: Path) -> str:
    """Path of a not-yet-existing log."""
    return str(tmp_path / "events.db")


def _closed_at_teardown(lg):
    yield lg
    if not lg.closed:
        lg.discard()
    lg.close()


@pytest.fixture
def log(path: str):
    """A fresh EventLog writer, closed at teardown."""
    yield from _closed_at_teardown(RECORDERS["EventLog"](path))


@pytest.fixture
def recorder(request, path: str):
    """A fresh writer of one recorder (see pytest_generate_tests), closed at teardown; an EventLog's
    file is at `path`."""
    yield from _closed_at_teardown(RECORDERS[request.param](path))

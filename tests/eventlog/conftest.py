"""Shared fixtures for the eventlog tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventlog import EventLog


@pytest.fixture
def path(tmp_path: Path) -> str:
    """Path of a not-yet-existing log."""
    return str(tmp_path / "events.db")


@pytest.fixture
def log(path: str):
    """A fresh writer, closed at teardown."""
    lg = EventLog.create(path, meta={"seed": "1"})
    yield lg
    if not lg.closed:
        lg.discard()
    lg.close()

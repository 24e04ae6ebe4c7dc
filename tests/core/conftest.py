"""The `driver` fixture: the pure core driven by hand, one input at a time."""

from __future__ import annotations

import pytest

from tests.support.params import Driver


@pytest.fixture
def driver():
    return Driver

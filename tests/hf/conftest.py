"""Fixtures of the hf tests (their helpers are in hf_helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_helpers import write_untrained


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_untrained(tmp_path_factory.mktemp("tiny-model"))

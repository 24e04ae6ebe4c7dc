"""Real runs (fake env and trainer) to observe, shared by the module's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.observe.util import run_fake


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two busy runs of different seeds; `a` also fed TensorBoard."""
    runs_dir = tmp_path_factory.mktemp("runs")
    return {
        "a": run_fake(runs_dir, "a", "--set", "metrics.tensorboard=true"),
        "b": run_fake(runs_dir, "b", "--set", "seed=7"),
    }

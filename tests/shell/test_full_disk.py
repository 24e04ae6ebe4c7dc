"""A full disk stops a run in one line, and once space is free the run resumes and checks: at
creation (nothing half-made is left) and at any point of the run, a checkpoint of the log's WAL
that the full disk cut short included (docs/resume.md)."""

from __future__ import annotations

import os

import pytest

from tests.support.cli import orch
from tests.support.disk import fill, tmpfs
from tests.support.runs import FAKE, sets

pytestmark = pytest.mark.slow

RUN = [*FAKE, *sets("env.fake.prompt_tokens=200", "batch.size=64"), "--max-steps", "8"]
MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    with tmpfs(tmp_path, "20m") as mount:
        yield mount


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("orch: error:")]


@pytest.mark.parametrize("free_kib", [0, 64, 256, 1229, 1434, 1638, 1843, 2048, 2458, 3072])
def test_a_run_a_full_disk_stopped_resumes_once_space_is_free_and_checks(small_fs, free_kib):
    runs = small_fs / "runs"
    runs.mkdir()
    filler = fill(small_fs, free_kib * 1024)
    first = orch("run", *RUN, "--runs-dir", str(runs), "--name", "r")
    run = runs / "r"
    if first.returncode != 0:
        assert "Traceback" not in first.stderr and len(_errors(first.stderr)) == 1, first.stderr
    os.unlink(filler)
    if (run / "events.db").exists():
        again = orch("run", "--resume", str(run), "--max-steps", "8")
        assert again.returncode == 0 or "is complete at step 8" in again.stderr, again.stderr
    else:  # stopped at creation: nothing half-made blocks the same command
        again = orch("run", *RUN, "--runs-dir", str(runs), "--name", "r")
        assert again.returncode == 0, again.stderr
    check = orch("replay", str(run), "--check")
    assert check.returncode == 0, check.stdout + check.stderr

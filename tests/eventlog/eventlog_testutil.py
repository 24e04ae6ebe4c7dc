"""Helpers shared by the eventlog tests (a unique module name: tests/ has no packages)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = str(Path(__file__).with_name("_child.py"))


def spawn_child(*args: str, wait_ready: bool = True) -> subprocess.Popen:
    """Start _child.py with ``args``; by default wait until it printed READY."""
    proc = subprocess.Popen(
        [sys.executable, CHILD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if not wait_ready:
        return proc
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child failed to start: {line}{out}{err}")
    return proc

"""`orch` in a subprocess, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def orch_argv(*args: str) -> list[str]:
    """The command line of `orch ARGS...` with this interpreter (so it sees this checkout)."""
    return [sys.executable, "-m", "orchestrator.cli", *args]


def orch(*args: str, env: dict | None = None, timeout: float = 240, **run: Any) -> subprocess.CompletedProcess:
    """`orch ARGS...` to its end, its output captured (`env`: its environment, default this one's;
    `run`: more `subprocess.run` arguments, e.g. `cwd`)."""
    return subprocess.run(orch_argv(*args), capture_output=True, text=True, timeout=timeout, env=env, **run)


def spawn_orch(*args: str, stdout: Any = subprocess.DEVNULL, **popen: Any) -> subprocess.Popen:
    """`orch ARGS...` started and left running, its stderr piped (text) for the failure message."""
    return subprocess.Popen(orch_argv(*args), stdout=stdout, stderr=subprocess.PIPE, text=True, **popen)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` every 0.1 s; fail after `timeout` s naming `what` it waited for."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def kill_once(proc: subprocess.Popen, reached: Callable[[], bool], timeout: float, what: str) -> None:
    """SIGKILL a running `orch` once `reached()` holds (waited for as `wait_until` waits, and
    failing with its stderr if it exited first); it is killed and reaped however this ends."""
    try:
        wait_until(lambda: proc.poll() is not None or reached(), timeout, what)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

"""What makes the trainer a well-behaved child process: exit codes, one-line errors, a watchdog
that ends it when the process that started it is gone, and the wait of a trainer started before
its run (`wait_for_start`)."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from orchestrator.trainers.process import START_LINE

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PARENT_DIED = 0, 1, 130, 3


class TrainerError(RuntimeError):
    """A clear, user-facing trainer failure (bad batch, timeout, config mismatch)."""


class TrainerSetupError(TrainerError):
    """A setup mistake (no usable trainer.json, a model dir that does not load): reported in one
    line, without a traceback."""


def _parent_alive(pid: int, initial_ppid: int) -> bool:
    if pid == initial_ppid and os.getppid() != pid:
        return False  # we were re-parented: our parent is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead but unreaped parent is a zombie
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def start_parent_watchdog(pid: int, period_s: float = 0.2) -> threading.Thread:
    """Daemon thread: when `pid` dies, print a line and ``os._exit(3)`` (every file the trainer
    writes is written atomically, so dying mid-write leaves only temp files, cleaned at start)."""
    initial_ppid = os.getppid()

    def watch() -> None:
        while True:
            if not _parent_alive(pid, initial_ppid):
                print(f"orch trainer: parent process {pid} is gone; exiting", file=sys.stderr, flush=True)
                os._exit(EXIT_PARENT_DIED)
            time.sleep(period_s)

    thread = threading.Thread(target=watch, name="orch-trainer-parent-watch", daemon=True)
    thread.start()
    return thread


def exit_code_of(body: Callable[[], None], where: str = "") -> int:
    """Run `body` and turn its outcome into the trainer's exit code: 0, 130 on interrupt, or 1
    after a one-line ``orch trainer: error: ...`` summary (what the orchestrator quotes) plus the
    traceback (none for a setup mistake)."""
    try:
        body()
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"orch trainer: {where}interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - reported in full just below
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"orch trainer: error: {where}{msg}", file=sys.stderr, flush=True)
        if not isinstance(exc, TrainerSetupError):
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        return EXIT_ERROR


def wait_for_start(log_path: Path) -> bool:
    """A trainer started before its run directory exists (`orch trainer --wait-for-start`, its
    imports done) waits here for the orchestrator's start line on stdin. Then its output so far
    (held in the temporary file the orchestrator gave it as stdout) and all after it go to
    `log_path`, and it trains (True). End of input instead: the orchestrator did not need it (a
    refused model, an interrupt) or is gone, and it exits having done nothing (False)."""
    if sys.stdin.buffer.readline() != START_LINE:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, "ab") as log, os.fdopen(os.dup(sys.stdout.fileno()), "rb") as held:
        held.seek(0)
        log.write(held.read())
        log.flush()
        for fd in (sys.stdout.fileno(), sys.stderr.fileno()):
            os.dup2(log.fileno(), fd)
    return True

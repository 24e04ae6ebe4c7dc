"""tests/support/busy.py (`make test-busy`): the command runs beside two busy processes, which
are gone once it ends, whether it fails or ^C ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = ROOT / "tests" / "support" / "busy.py"
# the command: its parent's other children (the busy processes) to a file, then exit 3
LIST_SIBLINGS = (
    "import os, pathlib, sys; me, parent = os.getpid(), os.getppid(); "
    "kids = pathlib.Path(f'/proc/{parent}/task/{parent}/children').read_text().split(); "
    "pathlib.Path(sys.argv[1]).write_text(' '.join(k for k in kids if int(k) != me)); sys.exit(3)"
)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
    except FileNotFoundError:
        return ""


def test_the_command_runs_beside_two_busy_processes_gone_once_it_fails(tmp_path):
    listed = tmp_path / "siblings"
    done = subprocess.run(
        [sys.executable, str(BUSY), sys.executable, "-c", LIST_SIBLINGS, str(listed)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    busy = [int(pid) for pid in listed.read_text().split()]
    assert len(busy) == 2 and f"pids {busy[0]} {busy[1]}" in done.stderr, (busy, done.stderr)
    assert not any(cmdline(pid) for pid in busy)  # killed and reaped


def test_ctrl_c_ends_the_command_and_the_busy_processes(tmp_path):
    wrapper = subprocess.Popen(  # a process group of its own, as a terminal's foreground job
        [sys.executable, str(BUSY), "sleep", "60"], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = wrapper.stderr.readline()  # written once the busy processes run
        busy = [int(pid) for pid in line.split("(pids ")[1].split(")")[0].split()]
        children = Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children")
        # the busy processes and the command running (exec'd: a child forked and not yet exec'd
        # would not act on the ^C) before the ^C
        deadline = time.monotonic() + 30
        running = sorted(["sleep", sys.executable, sys.executable])
        while sorted(cmdline(int(pid)).split(" ")[0] for pid in children.read_text().split()) != running or not all(
            "getppid" in cmdline(pid) for pid in busy
        ):
            assert time.monotonic() < deadline, f"busy.py's children not all running within 30s: {children.read_text()}"
            time.sleep(0.05)
        os.killpg(wrapper.pid, signal.SIGINT)  # what ^C sends to the foreground job
        assert wrapper.wait(timeout=30) == 128 + signal.SIGINT
        assert not any(cmdline(pid) for pid in busy)
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
            wrapper.wait()

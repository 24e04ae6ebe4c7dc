"""The guard of a server orch launches: `python -m orchestrator.inference.server_guard PARENT_PID
STOP_TIMEOUT_S -- COMMAND...`.

A vLLM server is a process tree (the API server forks its engine core and workers) whose start-up
survives a SIGTERM, so a death signal sent to the API server alone (``PR_SET_PDEATHSIG``) can leave
the whole tree running, ~3 GiB, after a SIGKILLed orch. The guard leads the server's process group
(the launcher starts it in a session of its own) and runs COMMAND in that group. It ends the whole
group, SIGTERM then SIGKILL after STOP_TIMEOUT_S, as soon as orch is gone (its death signal, or its
parent pid no longer PARENT_PID: a death signal is lost when the thread that forked exits) or when
told to stop (SIGTERM); it exits with COMMAND's exit code when COMMAND exits by itself (128 + N
when signal N killed it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2


def main(argv: list[str]) -> int:
    parent, stop_timeout_s, command = int(argv[0]), float(argv[1]), argv[argv.index("--") + 1 :]
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append("told to stop"))
    child = subprocess.Popen(command)  # inherits the guard's group, stdout and stderr
    while child.poll() is None:
        if stopping or os.getppid() != parent:
            _end_group(child, stop_timeout_s)
            return 0
        time.sleep(POLL_S)
    _kill_the_rest()  # what COMMAND forked and left behind (an engine core whose API server died)
    code = child.returncode
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says it


def _kill_the_rest() -> None:
    me, group = os.getpid(), os.getpgrp()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == group:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue


def _end_group(child: subprocess.Popen, stop_timeout_s: float) -> None:
    """SIGTERM to the group (the guard ignores it now), SIGKILL to the group (the guard with it)
    once COMMAND has exited or `stop_timeout_s` passed."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    try:
        child.wait(stop_timeout_s)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

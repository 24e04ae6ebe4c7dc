"""The guard of a process tree orch starts (a vLLM server; a trainer's job step under SLURM, whose
``srun`` ends the step when it goes): `python -m orchestrator.process_guard PARENT_PID
STOP_TIMEOUT_S -- COMMAND...`.

A vLLM server is a process tree (the API server forks its engine core and workers) whose start-up
survives a SIGTERM, so a death signal sent to the API server alone (``PR_SET_PDEATHSIG``) can leave
the whole tree running, ~3 GiB, after a SIGKILLed orch. The guard leads the server's process group
(the launcher starts it in a session of its own) and runs COMMAND in that group. It ends the whole
group, SIGTERM then SIGKILL after STOP_TIMEOUT_S, as soon as orch is gone (its death signal, or its
parent pid no longer PARENT_PID: a death signal is lost when the thread that forked exits) or when
told to stop (SIGTERM); it exits with COMMAND's exit code when COMMAND exits by itself (128 + N
when signal N killed it).

The guard is its tree's subreaper: what COMMAND forked and left behind is re-parented to the guard,
not to init, and the guard reaps it. So the guard exits only once every member of its group is
gone (or REAP_BOUND_S after their SIGKILL, for one stuck in the kernel; a descendant that left
the group with a session of its own is not waited for): a stop that has waited
for the guard has waited for the whole server, whatever init does with orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

POLL_S = 0.2
REAP_BOUND_S = 30.0  # SIGKILLed members: the kernel frees a ~3 GiB process well within this
_PR_SET_CHILD_SUBREAPER = 36


def guarded(command: list[str], stop_timeout_s: float) -> list[str]:
    """`command` run by its guard, which ends its whole process group once this process is
    gone, whenever that happens."""
    guard = [sys.executable, "-m", "orchestrator.process_guard", str(os.getpid()), str(stop_timeout_s)]
    return [*guard, "--", *command]


def main(argv: list[str]) -> int:
    parent, stop_timeout_s, command = int(argv[0]), float(argv[1]), argv[argv.index("--") + 1 :]
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append("told to stop"))
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # in the guard's group, with its stdout; the signals Python ignores back to their defaults
    child = os.posix_spawnp(command[0], command, os.environ, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    code = None
    while code is None:
        if stopping or os.getppid() != parent:
            _end_group(child, stop_timeout_s)
            return 0
        time.sleep(POLL_S)
        code = _reap_exited(child)
    _end_the_rest()  # what COMMAND forked and left behind (an engine core whose API server died)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says it


def _reap_exited(child: int) -> int | None:
    """Reaps every process of the tree that has exited (COMMAND, and what it left to the guard);
    COMMAND's exit code (-N: signal N) once it is among them."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # nothing left to wait for
            return code
        if pid == 0:
            return code
        if pid == child:
            code = os.waitstatus_to_exitcode(status)


def _end_the_rest() -> None:
    """SIGKILL to every other member of the guard's group, again until none is left (one forked
    meanwhile included), each reaped (the guard's children and orphans), at most REAP_BOUND_S.
    A descendant that left the group (setsid) is not the guard's to end, nor to wait for."""
    deadline = time.monotonic() + REAP_BOUND_S
    while _kill_the_rest() and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        time.sleep(0.02)


def _kill_the_rest() -> int:
    """SIGKILL to every member of the guard's group but the guard; how many there were (a
    killed one counts until it is reaped)."""
    me, group, members = os.getpid(), os.getpgrp(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == group:
                    os.kill(int(entry), signal.SIGKILL)
                    members += 1
    return members


def _end_group(child: int, stop_timeout_s: float) -> None:
    """SIGTERM to the group (the guard ignores it now), SIGKILL to the rest of the group once
    COMMAND has exited or `stop_timeout_s` passed, then every member reaped."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout_s
    while _reap_exited(child) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    _end_the_rest()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

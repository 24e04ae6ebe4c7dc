"""The guard of a launched server (orchestrator.process_guard) ends the server's whole
process group once orch is gone, at any moment, even for a server that ignores SIGTERM (vLLM's
start-up does) and has forked children (its engine core): real processes, no vLLM needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from orchestrator.inference.vllm_launch import group_alive, guarded

# A stand-in server: ignores SIGTERM, forks a child that ignores it too, then runs (or exits).
SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        time.sleep(120); os._exit(0)
    print("ready", flush=True)
    time.sleep(float(sys.argv[1])); sys.exit(3)
    """
)

# A stand-in orch: starts the guarded server in a session of its own, says its pid, waits.
ORCH = textwrap.dedent(
    """
    import subprocess, sys, time
    from orchestrator.inference.vllm_launch import guarded
    command = guarded([sys.executable, "-c", sys.argv[1], sys.argv[2]], 1.0)
    proc = subprocess.Popen(command, start_new_session=True)
    print(proc.pid, flush=True)
    time.sleep(120)
    """
)


def _wait_gone(pgid: int, within_s: float) -> float:
    start = time.monotonic()
    while group_alive(pgid):
        assert time.monotonic() - start < within_s, f"process group {pgid} still alive after {within_s}s"
        time.sleep(0.05)
    return time.monotonic() - start


def _group_size(pgid: int) -> int:
    return sum(1 for e in os.listdir("/proc") if e.isdigit() and _pgid(int(e)) == pgid)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_a_sigkilled_orch_takes_the_whole_server_group_with_it(tmp_path):
    orch = subprocess.Popen([sys.executable, "-c", ORCH, SERVER, "120"], stdout=subprocess.PIPE, text=True)
    try:
        guard = int(orch.stdout.readline())
        deadline = time.monotonic() + 30
        while _group_size(guard) < 3:  # the guard, the server and the server's child
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.05)
        os.kill(orch.pid, signal.SIGKILL)
        orch.wait()
        assert _wait_gone(guard, within_s=10) < 10  # SIGTERM ignored: SIGKILL after the 1 s stop timeout
    finally:
        orch.kill()


def test_told_to_stop_the_guard_ends_the_group():
    proc = subprocess.Popen(guarded([sys.executable, "-c", SERVER, "120"], 1.0), start_new_session=True)
    deadline = time.monotonic() + 30
    while _group_size(proc.pid) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # what VllmLauncher.stop sends first
    assert proc.wait(10) == 0  # SIGTERM ignored: SIGKILL after the 1 s stop timeout, then reaped
    # The guard reaps what it SIGKILLed (the server's orphaned child is the guard's, not init's):
    # once the guard has exited, nothing of its group is left, with no wait.
    assert not group_alive(proc.pid)


def test_a_server_that_exits_by_itself_gives_its_code_and_leaves_nothing():
    proc = subprocess.Popen(guarded([sys.executable, "-c", SERVER, "1"], 1.0), start_new_session=True)
    assert proc.wait(30) == 3
    assert not group_alive(proc.pid)  # its orphaned child killed and reaped before the guard exits


def test_stop_does_not_wait_out_its_timeout_on_a_stopped_guard():
    """A guard stopped (SIGSTOP) while its server runs: `VllmLauncher.stop` continues it, so the
    shutdown takes as long as the server's own exit, not the whole stop timeout."""
    # A server that exits on SIGTERM (as a ready vLLM does), with its guard's 1 s SIGKILL fallback.
    obeying = "import signal, sys, time; print('ready', flush=True); time.sleep(120)"
    proc = subprocess.Popen(guarded([sys.executable, "-c", obeying], 1.0), start_new_session=True)
    try:
        _stop_a_stopped_guard(proc)
    finally:  # whatever failed, no stopped guard is left behind
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stop_a_stopped_guard(proc: subprocess.Popen) -> None:
    from types import SimpleNamespace

    from orchestrator.inference.vllm_launch import VllmLauncher

    deadline = time.monotonic() + 30
    while _group_size(proc.pid) < 2:
        assert time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGSTOP)
    while _state(proc.pid) != "T":  # stopped once the kernel has delivered the signal
        assert time.monotonic() < deadline, "the guard did not stop"
        time.sleep(0.01)
    launcher = SimpleNamespace(
        servers=[SimpleNamespace(proc=proc, name="vLLM server 0 (http://127.0.0.1:1)")],
        launch=SimpleNamespace(stop_timeout_s=60.0),
    )
    start = time.monotonic()
    VllmLauncher.stop(launcher)  # type: ignore[arg-type]
    took = time.monotonic() - start
    assert proc.returncode is not None and not group_alive(proc.pid)
    assert took < 30, f"stop waited {took:.1f}s on a stopped guard (its stop timeout: 60 s)"

"""The launcher watches the servers it launched for the whole run (docs/vllm.md, "When a server
dies or hangs"): a dead or frozen one is marked down, named, restarted a bounded number of times,
brought to the newest version and put back in rotation, each down and up reported. The servers
here are real `orch serve` processes (they start in a second) under the launcher's own guard and
process groups; test_vllm_faults.py does it with vLLM."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from orchestrator.inference.client import InferenceClient
from orchestrator.inference.endpoints_config import LaunchSection
from orchestrator.inference.errors import InferenceError
from orchestrator.inference.vllm_launch import LaunchError, Server, VllmLauncher, group_alive
from orchestrator.rundir import MODEL_FILE, POLICY_FILE, mark_stable, weights_dir
from tests.inference.util import publish, run
from tests.support.cli import orch_argv


class ServeLauncher(VllmLauncher):
    """The launcher, starting `orch serve` on the run's weights instead of vLLM."""

    def command(self, server: Server) -> list[str]:
        weights = str(self.model_dir / "weights" / "step_0")
        return orch_argv("serve", "--host", server.host, "--port", str(server.port), "--weights", weights)


def _server_pid(server: Server) -> int:
    """The server process itself: its guard's one child."""
    guard = server.proc.pid
    (child,) = Path(f"/proc/{guard}/task/{guard}/children").read_text().split()
    return int(child)


async def _until(changes: list, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(changes) < count:
        assert time.monotonic() < deadline, f"waited {timeout_s:g}s for {count} changes: {changes}"
        await asyncio.sleep(0.1)


class KeepAliveRaceLauncher(VllmLauncher):
    """The launcher, starting a server that closes every kept-alive connection as its next
    request arrives (tests/inference/keepalive_race_server.py) instead of vLLM."""

    def command(self, server: Server) -> list[str]:
        race = [sys.executable, "-m", "tests.inference.keepalive_race_server"]
        return [*race, "--host", server.host, "--port", str(server.port)]


def test_a_connection_the_server_closed_as_a_probe_was_sent_is_not_a_server_down(tmp_path):
    """A server's keep-alive timeout that lapses as a probe is sent on the kept-alive connection
    (a transport error, the server healthy) marks nothing down: each probe has a fresh one."""
    launch = LaunchSection(servers=1, max_restarts=0, health_timeout_s=5.0, ready_timeout_s=60.0, stop_timeout_s=5.0)
    launcher = KeepAliveRaceLauncher(launch, tmp_path, tmp_path, "orch", 2)
    changes: list[tuple[str, bool, int, str]] = []
    (server,) = launcher.servers

    def probes_answered() -> int:
        return server.log_path.read_text().count("answered /health")

    async def go():
        launcher.start()
        await launcher.wait_ready()
        async with InferenceClient(launcher.urls, weight_sync="orch") as client:
            async with asyncio.TaskGroup() as tasks:
                watch = tasks.create_task(launcher.watch(client, lambda *change: changes.append(change)))
                seen = probes_answered()
                deadline = time.monotonic() + 60
                # three of the watch's probes, each of which would have gone on a kept-alive one
                while probes_answered() < seen + 3 and not watch.done():
                    assert time.monotonic() < deadline, f"the watch's probes: {probes_answered() - seen} in 60s"
                    await asyncio.sleep(0.1)
                assert not watch.done() and changes == []
                watch.cancel()

    try:
        run(go(), timeout=120)
    finally:
        launcher.stop()
    assert changes == [] and not group_alive(server.proc.pid)


def test_a_dead_or_frozen_server_is_restarted_brought_to_the_newest_version_then_given_up(tmp_path, capfd):
    for version in (0, 1):
        publish(tmp_path, version)
    launch = LaunchSection(servers=2, max_restarts=1, health_timeout_s=1.0, ready_timeout_s=60.0, stop_timeout_s=5.0)
    launcher = ServeLauncher(launch, tmp_path, tmp_path, "orch", 2)
    changes: list[tuple[str, bool, int, str]] = []

    async def go():
        launcher.start()
        await launcher.wait_ready()
        async with InferenceClient(launcher.urls, weight_sync="orch", backoff_s=0.2) as client:
            await client.load(1, str(tmp_path / "weights" / "step_1"))
            watch = asyncio.create_task(launcher.watch(client, lambda *change: changes.append(change)))
            a, b = launcher.servers
            t0 = time.monotonic()
            os.kill(_server_pid(a), signal.SIGKILL)  # dies
            await _until(changes, 2)
            noticed_dead = time.monotonic() - t0
            assert [c[:3] for c in changes] == [(a.url, False, 0), (a.url, True, 1)]
            # The exit and the log file, not the log's last line (an access line of the load it served).
            assert changes[0][3] == f"exited (killed by SIGKILL), it logged no error (log: {a.log_path})"
            assert changes[1][3] == "restarted, at version 1"
            assert client.endpoints[0].version == 1 and client.endpoints[0].failures == 0
            frozen = _server_pid(b)
            os.kill(frozen, signal.SIGSTOP)  # hangs
            await _until(changes, 4)
            assert [c[:3] for c in changes[2:]] == [(b.url, False, 0), (b.url, True, 1)]
            assert "within 1s (frozen)" in changes[2][3] and client.endpoints[1].version == 1
            assert not Path(f"/proc/{frozen}").exists() or Path(f"/proc/{frozen}/stat").read_text().split()[2] == "Z"
            os.kill(_server_pid(a), signal.SIGKILL)  # past its restarts, while the other serves: left down
            await _until(changes, 5)
            assert changes[4][:3] == (a.url, False, 1) and not watch.done()
            os.kill(_server_pid(b), signal.SIGKILL)  # and then no server is left: one line
            with pytest.raises(LaunchError, match=r"no server left \(inference.openai.launch.max_restarts\)"):
                await asyncio.wait_for(watch, 30)
            return noticed_dead

    try:
        noticed_dead = run(go(), timeout=240)
    finally:
        launcher.stop()
    assert noticed_dead < 60
    assert not any(group_alive(s.proc.pid) for s in launcher.servers)
    err = capfd.readouterr().err
    assert "restarting it (1/1)" in err and "is back, at version 1" in err and "left down" in err


def test_a_server_stuck_in_a_load_is_restarted_and_brought_to_the_newest_version(tmp_path, capfd):
    """A load that misses the load timeout while the server still answers /health (as a push
    receive whose sender vanished does; here a weights file nobody writes, a FIFO) is a server
    stuck in it (its /health answers, so it is not frozen): marked down, restarted, brought to
    the newest version, each an event. Without it, the server would stay down for good."""
    for version in (0, 1):
        publish(tmp_path, version)
    launch = LaunchSection(servers=1, max_restarts=1, health_timeout_s=5.0, ready_timeout_s=60.0, stop_timeout_s=5.0)
    launcher = ServeLauncher(launch, tmp_path, tmp_path, "orch", 2)
    changes: list[tuple[str, bool, int, str]] = []
    real = publish(tmp_path / "elsewhere", 2)
    stuck = weights_dir(tmp_path, 2)
    stuck.mkdir()
    shutil.copy(real / POLICY_FILE, stuck / POLICY_FILE)
    os.mkfifo(stuck / MODEL_FILE)  # its reader blocks in open() until a writer comes: none does
    mark_stable(stuck)
    (server,) = launcher.servers

    async def go():
        launcher.start()
        await launcher.wait_ready()
        async with InferenceClient(launcher.urls, weight_sync="orch", backoff_s=0.2, load_timeout_s=3.0) as client:
            await client.load(1, str(weights_dir(tmp_path, 1)))
            async with asyncio.TaskGroup() as tasks:
                watch = tasks.create_task(launcher.watch(client, lambda *change: changes.append(change)))
                with pytest.raises(InferenceError, match="no inference endpoint confirmed weights version 2"):
                    await client.load(2, str(stuck))
                # the real file in its place before the watch's restart can load it (no await between)
                os.replace(real / MODEL_FILE, stuck / MODEL_FILE)
                await _until(changes, 2)
                watch.cancel()
            return client.endpoints[0].version

    try:
        version = run(go(), timeout=120)
    finally:
        launcher.stop()
    assert version == 2
    assert [c[:3] for c in changes] == [(server.url, False, 0), (server.url, True, 1)]
    assert changes[0][3].startswith("did not load version 2 within 3s (POST ") and "stuck in it" in changes[0][3]
    assert changes[1][3] == "restarted, at version 2"
    assert not group_alive(server.proc.pid)
    assert "restarting it (1/1)" in capfd.readouterr().err


@pytest.mark.parametrize(
    "servers, cores, shares",
    [(2, [0, 1], ["0", "1"]), (2, [0, 1, 2, 3, 4], ["0,1", "2,3"]), (3, [4, 6], ["4", "6", "4"])],
)
def test_several_cpu_servers_are_each_bound_to_their_own_cores(servers, cores, shares):
    from orchestrator.inference.vllm_launch import cpu_share

    assert [cpu_share(i, servers, cores) for i in range(servers)] == shares


def test_the_launcher_binds_cpu_servers_apart_only_when_there_are_several(tmp_path):
    def binding(launch: LaunchSection) -> list[str | None]:
        launcher = VllmLauncher(launch, tmp_path, tmp_path / "run", "vllm_reload", 2)
        return [launcher.environment(s).get("VLLM_CPU_OMP_THREADS_BIND") for s in launcher.servers]

    assert binding(LaunchSection(servers=1)) == [os.environ.get("VLLM_CPU_OMP_THREADS_BIND")]
    assert all(binding(LaunchSection(servers=2)))
    assert binding(LaunchSection(servers=2, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})) == ["nobind", "nobind"]


def test_a_dead_servers_last_error_line_is_never_an_access_log_line(tmp_path):
    from orchestrator.inference.vllm_launch import last_error_line

    log = tmp_path / "vllm-0.log"
    log.write_text(
        "INFO 12-03 10:00:00 [api_server.py:1] Started server process\n"
        "ERROR 12-03 10:00:05 [core.py:2] EngineCore failed: RuntimeError: out of memory\n"
        'INFO:     127.0.0.1:5555 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
        'INFO:     127.0.0.1:5556 - "POST /v1/completions HTTP/1.1" 200 OK\n'
    )
    assert last_error_line(log) == "ERROR 12-03 10:00:05 [core.py:2] EngineCore failed: RuntimeError: out of memory"
    log.write_text('INFO:     127.0.0.1:5556 - "POST /v1/completions HTTP/1.1" 200 OK\n')
    assert last_error_line(log) is None
    assert last_error_line(tmp_path / "missing.log") is None

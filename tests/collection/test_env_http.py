"""End to end against a real uvicorn server on 127.0.0.1 (ephemeral port): env server + client,
disconnect-driven cancellation, and run_examples over HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from orchestrator.config import served_env
from orchestrator.envs.client import EnvServerError, EnvServerTimeout, HttpEnvClient
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.envs.server import RunningServer, create_app, running_server
from tests.support.wakeups import rollouts_of

SEED = 7
CANCEL_BOUND_S = 10.0  # a hang guard: an uncancelled handler sleeps 60 s and never counts as cancelled


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(create_app(served_env("reverse_text", SEED))) as srv:
        yield srv


async def _wait_for(predicate, bound: float, what: str) -> None:
    """Poll an async predicate until true, for at most `bound` seconds."""
    try:
        async with asyncio.timeout(bound):
            while not await predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {bound}s") from None


def test_task_score_round_trip(arun, server):
    env = ReverseTextEnv(seed=SEED)

    async def main():
        async with HttpEnvClient(server.base_url) as client:
            assert await client.health() == {
                "status": "ok",
                "env": "reverse_text",
                "params": {"seed": SEED, "min_len": 3, "max_len": 6},
            }
            for index in (0, 3, 12345):
                task = await client.task(index)
                assert task == env.task(index)
                assert await client.score(task, f"sure: {task.answer}") == 1.0
                wrong = "<reversed_text>zz</reversed_text>"
                assert await client.score(task, wrong) == pytest.approx(env.score(task, wrong))
                assert await client.score(task, "no tags") == 0.0

    arun(main)


def test_clear_errors(arun, server):
    async def main():
        async with HttpEnvClient(server.base_url) as client:
            with pytest.raises(EnvServerError, match="HTTP 400.*index") as err:
                await client.task(-1)
            assert err.value.status_code == 400
            task = await client.task(1)
            other = type(task)(env="other_env", index=1, prompt=task.prompt, answer=task.answer)
            with pytest.raises(EnvServerError, match="hosts env 'reverse_text', not 'other_env'"):
                await client.score(other, "x")

        with socket.socket() as sock:  # a port with nothing listening
            sock.bind(("127.0.0.1", 0))
            dead_port = sock.getsockname()[1]
        async with HttpEnvClient(f"http://127.0.0.1:{dead_port}", connect_timeout=1) as client:
            with pytest.raises(EnvServerError, match="unreachable"):
                await client.task(0)

        async with HttpEnvClient(server.base_url, timeout=0.2) as client:
            task = await client.task(2)
            with pytest.raises(EnvServerTimeout, match="no answer within 0.2s"):
                await client.score(task, "x", delay_s=5)

    arun(main)


def test_cancelled_request_cancels_server_handler_and_is_not_retried(arun, server):
    async def main():
        async with HttpEnvClient(server.base_url) as client:
            before = await client.stats()
            task = await client.task(5)
            call = asyncio.create_task(client.score(task, task.answer, delay_s=60))

            async def started():
                return (await client.stats())["score_started"] == before["score_started"] + 1

            await _wait_for(started, 5, "score handler started")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

            async def server_cancelled():
                return (await client.stats())["score_cancelled"] == before["score_cancelled"] + 1

            await _wait_for(server_cancelled, CANCEL_BOUND_S, "server handler cancelled")
            await asyncio.sleep(0.3)  # a retry would show up as a second start
            after = await client.stats()
            assert after["score_started"] == before["score_started"] + 1, "cancelled request was retried"
            assert after["score_completed"] == before["score_completed"]
            assert after["disconnect_cancels"] == before["disconnect_cancels"] + 1
            # the client is still usable after a cancelled call (new connection)
            assert await client.score(task, task.answer) == 1.0

    arun(main)


def test_rollout_stream_close_and_drain_over_http(arun, server):
    """aclose()/aclose_and_drain() cancel in-flight HTTP rollouts; the server sees each handler
    cancelled; completed outcomes survive the drain."""

    async def main():
        async with HttpEnvClient(server.base_url) as client:
            s0 = await client.stats()

            async def rollout(example: tuple[int, float]) -> float:
                index, delay = example
                task = await client.task(index)
                return await client.score(task, task.answer, delay_s=delay)

            # aclose: 6 slow rollouts, all withdrawn
            stream = rollouts_of([(i, 60.0) for i in range(6)], rollout)

            async def all_started():
                return (await client.stats())["score_started"] >= s0["score_started"] + 6

            await _wait_for(all_started, 5, "6 handlers started")
            await stream.aclose()  # the rollouts take 60 s: returning within the test's bound means withdrawn

            async def all_cancelled():
                return (await client.stats())["score_cancelled"] >= s0["score_cancelled"] + 6

            await _wait_for(all_cancelled, CANCEL_BOUND_S, "6 server handlers cancelled")

            # drain: 3 fast (completed, kept), 3 slow (cancelled on the server)
            s1 = await client.stats()
            stream = rollouts_of([(i, 0.0 if i % 2 == 0 else 60.0) for i in range(6)], rollout)

            async def three_ready():
                return len(stream) == 3 and (await client.stats())["score_started"] >= s1["score_started"] + 6

            await _wait_for(three_ready, 5, "3 outcomes ready, 3 slow handlers running")
            assert await stream.aclose_and_drain() == 3
            got = sorted((o.key, o.result) for o in stream.take_ready())
            assert got == [(0, 1.0), (2, 1.0), (4, 1.0)] and stream.done

            async def three_cancelled():
                return (await client.stats())["score_cancelled"] >= s1["score_cancelled"] + 3

            await _wait_for(three_cancelled, CANCEL_BOUND_S, "3 server handlers cancelled")
            await asyncio.sleep(0.2)
            s2 = await client.stats()
            assert s2["score_started"] == s1["score_started"] + 6  # nothing retried
            assert s2["score_completed"] == s1["score_completed"] + 3

    arun(main)


def test_an_env_server_serves_the_envs_of_the_run_configs_registry():
    assert served_env("reverse_text", 3, max_len=9).params == {"seed": 3, "min_len": 3, "max_len": 9}
    with pytest.raises(
        ValueError, match="unknown env 'nope'; known: dataset, fake, nemo_gym, reasoning_gym, reverse_text, verifiers"
    ):
        served_env("nope")
    with pytest.raises(
        ValueError, match="^env 'fake' cannot be served by an env server; these can: reasoning_gym, reverse_text$"
    ):
        served_env("fake")
    with pytest.raises(ValueError, match="^max_len: Input should be greater than or equal to 1$"):
        served_env("reverse_text", max_len=0)


def test_cli_serves_over_http_in_a_subprocess(arun):
    """`python -m orchestrator.envs.cli` (the command behind `orch env-server`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.envs.cli", "--port", "0", "--seed", "3", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        base_url = None
        assert proc.stdout is not None
        while base_url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "listening on " in line:
                base_url = line.rsplit("listening on ", 1)[1].strip()
        assert base_url, "env server did not report its address"

        async def main():
            async with HttpEnvClient(base_url) as client:
                task = await client.task(4)
                assert task == ReverseTextEnv(seed=3).task(4)
                assert await client.score(task, task.answer) == 1.0

        arun(main)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a graceful stop, one line, exit 130 (not click's "Aborted!")
        assert proc.wait(10) == 130
        assert proc.stdout.read().strip().splitlines()[-1] == "orch env-server: stopped on interrupt"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("command", [["orchestrator.envs.cli"], ["orchestrator.cli", "serve"]])
def test_a_port_in_use_is_one_line_and_exit_1(command):
    """uvicorn would call sys.exit inside its serve task: two tracebacks and an unretrieved task."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", *command, "--port", str(port)], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"orch: error: {'serve' if 'serve' in command else 'env-server'}: cannot listen on 127.0.0.1:{port}: "
        "Address already in use"
    ], done.stderr


# -- connections -------------------------------------------------------------------------------------
class _HoldingServer:
    """An HTTP/1.1 server on 127.0.0.1 that answers `{}` to every request once `release_at`
    requests have come (each held until then), counting the connections open at once."""

    def __init__(self, release_at: int) -> None:
        self.release_at, self.arrived, self.open, self.most_open = release_at, 0, 0, 0
        self.released = asyncio.Event()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.arrived += 1
                if self.arrived >= self.release_at:
                    self.released.set()
                await asyncio.wait_for(self.released.wait(), 60)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


async def _serving(handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_no_hidden_cap_on_calls_in_flight_and_a_set_one_holds(arun):
    """By default every call in flight has its own connection (300 answered only once all 300
    are at the server at once); `max_connections` caps them, the others waiting their turn."""

    async def main():
        at_once = _HoldingServer(release_at=300)
        server, url = await _serving(at_once.connection)
        async with server, HttpEnvClient(url, timeout=60) as client:
            answers = await asyncio.gather(*(client.health() for _ in range(300)))
        assert answers == [{}] * 300 and at_once.most_open == 300
        one_at_a_time = _HoldingServer(release_at=1)
        server, url = await _serving(one_at_a_time.connection)
        async with server, HttpEnvClient(url, max_connections=2) as client:
            assert await asyncio.gather(*(client.health() for _ in range(12))) == [{}] * 12
        assert one_at_a_time.arrived == 12 and one_at_a_time.most_open == 2
        with pytest.raises(ValueError, match="max_connections >= 1"):
            HttpEnvClient(url, max_connections=0)

    arun(main, timeout=120)


def test_an_idle_connection_is_not_reused_as_the_server_closes_it(arun):
    """A server whose keep-alive timer (1 s here, uvicorn's 5 s) fires as the next call comes on
    an idle connection: that call went unanswered (an EnvServerError, the server up); the client
    drops idle connections after KEEPALIVE_S and calls on a fresh one."""
    from orchestrator.http_limits import KEEPALIVE_S
    from tests.inference.keepalive_race_server import handler

    async def main():
        server, url = await _serving(handler(keep_alive_s=1.0))
        async with server, HttpEnvClient(url) as client:
            assert await client.health() == {}
            await asyncio.sleep(max(KEEPALIVE_S, 1.0) + 0.5)  # idle past both
            assert await client.health() == {}

    arun(main, timeout=60)


def test_a_connection_cap_below_the_episodes_in_flight_is_warned_in_one_line(capsys):
    from orchestrator.contracts import RunPlan
    from orchestrator.envs.reverse_text import ReverseTextConfig

    def check(section: ReverseTextConfig, in_flight: int) -> list[str]:
        section.check(RunPlan(envs=("reverse_text",), eval_envs=(), inference="embedded", requests_in_flight=in_flight))
        return capsys.readouterr().err.splitlines()

    served = "http://127.0.0.1:9"
    assert check(ReverseTextConfig(server=served), 1000) == []
    assert check(ReverseTextConfig(server=served, max_connections=64), 64) == []
    (line,) = check(ReverseTextConfig(server=served, max_connections=64), 65)
    assert "env.reverse_text.max_connections allows 64" in line and "the 65 episodes" in line
    assert check(ReverseTextConfig(max_connections=64), 65) == []  # in-process: no connection

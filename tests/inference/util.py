"""Helpers for the inference tests: tiny published weights, `orch serve` in a thread or a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

torch.set_num_threads(1)

from orchestrator.envs.server import running_server  # noqa: E402
from orchestrator.inference.vllm_launch import free_port  # noqa: E402
from orchestrator.rundir import mark_stable, weights_dir  # noqa: E402
from orchestrator.serve.policy import PolicyConfig, build_policy, save_weights  # noqa: E402
from orchestrator.serve.server import PolicyServer, create_app  # noqa: E402
from tests.support.cli import orch_argv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
TINY = PolicyConfig(d_model=16, layers=1, heads=2, d_ff=16)


def publish(run_dir: Path, version: int, seed: int | None = None) -> Path:
    """weights/step_{version} (+ STABLE) of a tiny random policy (seed defaults to the version)."""
    wdir = weights_dir(run_dir, version)
    save_weights(build_policy(TINY, seed=version if seed is None else seed), wdir)
    mark_stable(wdir)
    return wdir


class SlowPolicyServer(PolicyServer):
    """A real `orch serve` whose every completion first waits `delay_s` (slow endpoints), and
    while `held` is set, until the test clears it."""

    def __init__(self, delay_s: float, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s
        self.held = threading.Event()  # set and cleared by the test's thread, read by the server's

    async def sample(self, params, texts):
        await asyncio.sleep(self.delay_s)
        while self.held.is_set():
            await asyncio.sleep(0.01)
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
            orch_argv("serve", "--port", "0", *args),
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


def vllm_like_app(loaded: list):
    """A stand-in that speaks vLLM's dialect: LoRA adapters loaded and unloaded at runtime (listed
    by /v1/models), ids only as ``token_id:N`` strings in ``logprobs.tokens``, no
    ``policy_version``. (The real server: test_vllm_lora.py; this one answers in milliseconds.)"""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def load_lora(request):
        name = (await request.json())["lora_name"]
        if name not in loaded:
            loaded.append(name)
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request):
        name = (await request.json())["lora_name"]
        if name not in loaded:
            return JSONResponse(
                {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}}, status_code=404
            )
        loaded.remove(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(request):
        return JSONResponse({"data": [{"id": "base", "parent": None}] + [{"id": n, "parent": "base"} for n in loaded]})

    async def completions(request):
        body = await request.json()
        if body.get("model") not in loaded:
            return JSONResponse(
                {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}, status_code=404
            )
        v = int(body["model"].split("_")[1])
        return JSONResponse(
            {
                "object": "text_completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "text": "ba",
                        "finish_reason": "stop",
                        "logprobs": {
                            "tokens": [f"token_id:{t}" for t in (9, 8, 2)],
                            "token_logprobs": [-0.1 * v, -0.2, -0.3],
                        },
                    }
                ],
            }
        )

    return Starlette(
        routes=[
            Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


def weight_dirs(root, versions, lora: bool = False) -> list[str]:
    """`step_N` dirs with the files the client checks before it asks for a load: an HF model
    dir's (config.json, model.safetensors) or, with `lora`, an adapter's."""
    prefix = "adapter_" if lora else ""
    dirs = []
    for v in versions:
        wdir = root / f"step_{v}"
        wdir.mkdir(parents=True)
        (wdir / f"{prefix}config.json").write_text("{}")
        (wdir / f"{prefix}model.safetensors").write_bytes(b"")
        dirs.append(str(wdir))
    return dirs


def recorded(name: str) -> dict:
    return json.loads((DATA / f"vllm-0.32-{name}.json").read_text())


def replaying_vllm(calls: list[str], dev_mode: bool = True) -> Starlette:
    """Answers each route with what vLLM answered it (recorded); without ``dev_mode`` (vLLM
    started without VLLM_SERVER_DEV_MODE=1) the weight-reload routes are missing."""
    reload_seq = recorded("reload_sequence")

    def replay(step: dict) -> Response:
        return Response(step["text"], status_code=step["status"], media_type="application/json")

    async def handle(request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        calls.append(path)
        body = await request.json() if request.method == "POST" and await request.body() else None
        if path == "/v1/completions":
            rec = recorded("completion_lora" if str(body.get("model")).startswith("step_") else "completion")
            assert set(body) <= set(rec["request"]) | {"model"}, body  # nothing vLLM was not sent
            return JSONResponse(rec["response"])
        if path == "/v1/load_lora_adapter":
            return Response(recorded("lora_load_ok")["text"])
        if path == "/v1/unload_lora_adapter":
            return Response(recorded("lora_unload_ok")["text"])
        if path == "/v1/models":
            return JSONResponse(recorded("models_with_adapters")["response"])
        for step in reload_seq.values():
            if step["request"]["path"] == path and dev_mode:
                return replay(step)
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    return Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST"])])


ROUTER_READY_S = 60.0


@contextlib.contextmanager
def vllm_router(workers: list[str], log_path: Path) -> Iterator[str]:
    """A vllm-router process (consistent_hash) over `workers`, its URL once it answers /health;
    stopped (SIGTERM, then SIGKILL after 10 s) at the end."""
    binary = Path(sys.executable).parent / "vllm-router"  # the venv's, installed by pip install -e '.[dev]'
    assert binary.exists(), f"vllm-router is not installed beside {sys.executable} (pip install -e '.[dev]')"
    port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    command = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash"]
    command += ["--prometheus-port", str(metrics_port)]  # its default port is one for the whole machine
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*command, "--worker-urls", *workers], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_READY_S
        while True:
            assert proc.poll() is None, f"vllm-router exited with code {proc.returncode} (log: {log_path})"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"vllm-router not serving {url}/health within {ROUTER_READY_S:g}s"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

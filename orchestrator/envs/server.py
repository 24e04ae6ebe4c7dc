"""Serve an env over HTTP (starlette app, run by uvicorn) so rollouts can score in other processes.

Endpoints (JSON):

* ``POST /task  {"index": i}`` -> ``{"env", "index", "prompt", "answer", "messages"}``
* ``POST /score {"index": i, "completion": str[, "env": name][, "delay_s": float]}`` -> ``{"reward"}``
  (``delay_s`` overrides the server's ``score_delay_s``: a simulated slow grader)
* ``GET /health`` -> ``{"status": "ok", "env": name, "params": {...}}`` (what its tasks depend on)
* ``GET /stats`` -> request counters, including ``score_cancelled`` (handlers cancelled because the
  client went away)

:class:`DisconnectMiddleware` cancels a request's handler as soon as the client closes the
connection before the response is complete (ASGI ``http.disconnect``); uvicorn alone would let it
run to completion. Cancelled handlers are counted and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import click
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.contracts import TextEnv

__all__ = [
    "DisconnectMiddleware",
    "RunningServer",
    "create_app",
    "running_server",
    "serve",
]

log = logging.getLogger(__name__)

MAX_DELAY_S = 3600.0


def disconnect_cancelling_app(routes: list[Route], stats: dict[str, int]) -> Starlette:
    """A Starlette app whose handlers are cancelled when their client disconnects; `stats`
    (served at GET /stats) counts those cancellations under "disconnect_cancels"."""

    async def get_stats(request: Request) -> JSONResponse:
        return JSONResponse(dict(stats))

    def on_cancel(scope: Scope) -> None:
        stats["disconnect_cancels"] = stats.get("disconnect_cancels", 0) + 1

    return Starlette(
        routes=[*routes, Route("/stats", get_stats, methods=["GET"])],
        middleware=[Middleware(DisconnectMiddleware, on_cancel=on_cancel)],
    )


class DisconnectMiddleware:
    """Pure ASGI middleware: cancel the handler when the client disconnects mid-request.

    The app runs in a child task; this middleware keeps reading the server's ``receive`` and
    forwards the messages. An ``http.disconnect`` that arrives before the response is complete
    cancels the child task (``on_cancel(scope)`` is then called). A disconnect after the response
    is complete (normal close) cancels nothing.
    """

    def __init__(self, app: ASGIApp, on_cancel: Callable[[Scope], None] | None = None) -> None:
        self.app = app
        self.on_cancel = on_cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        response_complete = False

        async def app_send(message: Message) -> None:
            nonlocal response_complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_complete = True
            await send(message)

        app_task = asyncio.ensure_future(self.app(scope, inbox.get, app_send))
        recv: asyncio.Future[Message] | None = None
        cancelled_by_us = False
        try:
            while not app_task.done():
                if recv is None:
                    recv = asyncio.ensure_future(receive())
                await asyncio.wait((app_task, recv), return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    break
                message = recv.result()
                recv = None
                inbox.put_nowait(message)
                if message["type"] == "http.disconnect":
                    if not response_complete and not app_task.done():
                        cancelled_by_us = True
                        app_task.cancel()
                    break
            try:
                await app_task
            except asyncio.CancelledError:
                if not cancelled_by_us:
                    raise
                # Our own cancellation of the handler: the client is gone, nothing to answer.
                if self.on_cancel is not None:
                    self.on_cancel(scope)
                log.info("%s %s: client disconnected, handler cancelled", scope.get("method"), scope.get("path"))
        finally:
            if recv is not None and not recv.done():
                recv.cancel()
            if not app_task.done():  # we were cancelled ourselves (server shutdown)
                app_task.cancel()
                with contextlib.suppress(BaseException):
                    await app_task


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def _get_index(body: Any) -> int:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    index = body.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"'index' must be a non-negative integer, got {index!r}")
    return index


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from None


def create_app(env: TextEnv, *, score_delay_s: float = 0.0) -> Starlette:
    """The starlette app serving ``env``; ``app.state.stats`` holds the request counters."""
    if not (0.0 <= score_delay_s <= MAX_DELAY_S):
        raise ValueError(f"score_delay_s must be in [0, {MAX_DELAY_S}], got {score_delay_s}")
    stats: dict[str, int] = {
        "task": 0,
        "score_started": 0,
        "score_completed": 0,
        "score_cancelled": 0,
        "disconnect_cancels": 0,
    }

    async def task(request: Request) -> JSONResponse:
        try:
            index = _get_index(await _json_body(request))
        except ValueError as exc:
            return _bad_request(str(exc))
        stats["task"] += 1
        t = env.task(index)
        return JSONResponse(
            {"env": t.env, "index": t.index, "prompt": t.prompt, "answer": t.answer, "messages": t.messages}
        )

    async def score(request: Request) -> JSONResponse:
        try:
            body = await _json_body(request)
            index = _get_index(body)
            completion = body.get("completion")
            if not isinstance(completion, str):
                raise ValueError("'completion' must be a string")
            name = body.get("env", env.name)
            if name != env.name:
                raise ValueError(f"this server hosts env {env.name!r}, not {name!r}")
            delay = body.get("delay_s", score_delay_s)
            if (
                not isinstance(delay, (int, float))
                or isinstance(delay, bool)
                or not math.isfinite(delay)
                or not 0 <= delay <= MAX_DELAY_S
            ):
                raise ValueError(f"'delay_s' must be a number in [0, {MAX_DELAY_S}], got {delay!r}")
        except ValueError as exc:
            return _bad_request(str(exc))
        stats["score_started"] += 1
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            reward = env.score(env.task(index), completion)
        except asyncio.CancelledError:
            stats["score_cancelled"] += 1
            raise
        stats["score_completed"] += 1
        return JSONResponse({"reward": reward})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "env": env.name, "params": getattr(env, "params", None)})

    app = disconnect_cancelling_app(
        [
            Route("/task", task, methods=["POST"]),
            Route("/score", score, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        stats,
    )
    app.state.stats = stats
    app.state.env = env
    return app


def _config(app: ASGIApp, host: str, port: int, log_level: str) -> uvicorn.Config:
    # One worker, no reload, no lifespan; short graceful shutdown so stop() is bounded.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", timeout_graceful_shutdown=2)


def _bound_port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


class ListenError(OSError):
    """The server's address cannot be bound (in use, not local, not permitted)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 if ``host`` has a colon), as uvicorn binds its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


async def serve(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
    startup_timeout: float = 30.0,
) -> None:
    """Run ``app`` with uvicorn on this loop until the server exits (SIGINT/SIGTERM in the main
    thread). ``on_ready(base_url)`` is called once it listens (the real port when ``port=0``).
    Raises ListenError (one line) if ``host:port`` cannot be bound."""
    sock = listening_socket(host, port)  # here, not in uvicorn: it calls sys.exit inside its task
    server = uvicorn.Server(_config(app, host, port, log_level))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    await _started(server, task, f"env server on {host}:{port}", startup_timeout)
    if on_ready is not None:
        on_ready(f"http://{host}:{_bound_port(server)}")
    await task
    if server.should_exit:
        # Only uvicorn's signal handler sets it once the server runs. uvicorn re-raises the signal
        # on its way out, but asyncio.run turns that into a KeyboardInterrupt only if the main task
        # is still running when it lands: a race, so the interrupt is raised here.
        raise KeyboardInterrupt


async def _started(server: uvicorn.Server, task: asyncio.Future, what: str, startup_timeout: float) -> None:
    """Until uvicorn's `server` (running as `task`) serves; RuntimeError if it stopped first,
    TimeoutError (the server stopped) if it did not start within `startup_timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + startup_timeout
    while not server.started:
        if task.done():
            await task
            raise RuntimeError(f"{what} failed to start")
        if loop.time() > deadline:
            server.should_exit = True
            await task
            raise TimeoutError(f"{what} did not start within {startup_timeout}s")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(
    app: ASGIApp, what: str, *, host: str, port: int, startup_timeout: float = 10.0, stop_timeout: float = 5.0
) -> AsyncIterator[int]:
    """``app`` served by uvicorn on this loop for the block, without its signal handlers (the
    caller owns SIGINT/SIGTERM); yields the bound port (the real one when ``port=0``). Its task is
    this block's: asked to stop at the block's end, cancelled past ``stop_timeout``. ListenError
    (one line) if ``host:port`` cannot be bound."""
    sock = listening_socket(host, port)
    server = uvicorn.Server(_config(app, host, port, "warning"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await _started(server, task, f"{what} on {host}:{port}", startup_timeout)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), stop_timeout)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sock.close()


def serve_command_line(
    app: ASGIApp, command: str, *, host: str, port: int, log_level: str, on_ready: Callable[[str], None]
) -> None:
    """`serve` for a CLI command (`orch env-server`, `orch serve`): an address that cannot be
    bound (a port in use) is one line, `orch: error: COMMAND: ...`, and exit 1."""
    try:
        asyncio.run(serve(app, host=host, port=port, log_level=log_level, on_ready=on_ready))
    except ListenError as exc:
        click.echo(f"orch: error: {command}: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl-C
        click.echo(f"orch {command}: stopped on interrupt", err=True)
        sys.exit(130)


class RunningServer:
    """A uvicorn server running in a background thread (tests, embedded use)."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, base_url: str) -> None:
        self.server = server
        self.thread = thread
        self.base_url = base_url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"env server at {self.base_url} did not stop within {timeout}s")


@contextlib.contextmanager
def running_server(
    app: ASGIApp, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", startup_timeout: float = 30.0
) -> Iterator[RunningServer]:
    """Serve ``app`` with uvicorn in a daemon thread (its own event loop) for the ``with`` body."""
    server = uvicorn.Server(_config(app, host, port, log_level))
    thread = threading.Thread(target=server.run, name="env-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"env server failed to start on {host}:{port}")
        if time.monotonic() > deadline:
            server.should_exit = True
            thread.join(5)
            raise TimeoutError(f"env server did not start within {startup_timeout}s")
        time.sleep(0.005)
    handle = RunningServer(server, thread, f"http://{host}:{_bound_port(server)}")
    try:
        yield handle
    finally:
        handle.stop()

"""Client of several OpenAI-compatible completion endpoints (vLLM, SGLang, `orch serve`).

Routing: each request goes to the *up* endpoint with the fewest requests in flight (ties: the one
used least). With a ``pin`` key (the orchestrator passes the group id) every request of that key
goes to the endpoint its first request went to, so a group's shared prompt hits one prefix cache;
if that endpoint is down the request falls back to the least-loaded one and the key is re-pinned.

Failures: a transport failure (connect/read/write error, protocol error, timeout) or an HTTP 5xx
marks the endpoint down for ``backoff_s * 2**(k-1)`` (k: failed probes in a row; capped at
``max_backoff_s``; requests that were in flight when it broke count once) and the
request is retried on another endpoint, at most ``max_attempts`` attempts in all; then
:class:`InferenceUnavailable` says what each attempt got. An HTTP 4xx is the request's fault:
:class:`InferenceRequestError` at once, no retry. A cancelled request (drain/stop) is never
retried: ``CancelledError`` propagates, httpx drops the connection and the server's disconnect
middleware cancels the handler. A down endpoint is tried again once its backoff expires (the next
request that picks it is the probe); when every endpoint is down a request waits for the first
one to come back, still within its attempts, and for at most ``timeout_s`` (then
:class:`InferenceUnavailable` names every endpoint and its last error).

Weight updates (the contract): :meth:`InferenceClient.load` (version N, the published
``weights/step_N`` dir) is sent to every endpoint and returns once they answered; an endpoint
that did not confirm N is brought to the newest version before its next request (so a restarted
server catches up), and every completion reports the version it was sampled with. How an
endpoint loads a version, and which versions its completions then report, is its dialect's
(``inference.openai.weight_sync``: a module of :mod:`.weight_sync` each, which owns its
endpoints' state and waits); the client calls the dialect at fixed points of a load and of each
sampling call, and names none. With ``update_mode="interrupt"`` (a dialect that pauses its
endpoints to reload, vLLM's full reload) completions are streamed, the pause aborts them and each
is continued after the reload, its parts' versions in ``Completion.choice_versions``. With
``update_mode="keep"`` completions are sampled on vLLM's token-in, token-out route: the pause
freezes them, the engine continues them with the new weights and says which version sampled each
token (``Completion.choice_versions`` too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import httpx
import orjson

from orchestrator.core.events import version_runs
from orchestrator.http_limits import KEEPALIVE_S, pool_limits
from orchestrator.inference.endpoints_config import STREAM_INTERVAL, RouterSection
from orchestrator.inference.errors import (
    InferenceError,
    InferenceRequestError,
    InferenceUnavailable,
    Retryable,
    ServerError,
    same_server_error_again,
)
from orchestrator.inference.loop_lag import LoopLag
from orchestrator.inference.pacing import StartPacer
from orchestrator.inference.pool import ByOrigin, ShardedTransport
from orchestrator.inference.protocol import (
    GENERATE_PATH,
    ParsedChoice,
    ProtocolError,
    parse_completion,
    parse_generated,
)
from orchestrator.inference.sse import EventStreamDecoder
from orchestrator.inference.weight_sync import DIALECTS, names_where
from orchestrator.inference.weight_sync.base import UpdateMode
from orchestrator.urls import endpoint_base_urls

MAX_PINS = 65536
# interrupt: times a reload may end a completion before its first token; a reload then waits for
# that one's first token (bounded by load_timeout_s), so that a slow-starting request is not
# restarted at every reload
MAX_RESTARTS = 2
JSON_HEADERS = {"content-type": "application/json"}
T = TypeVar("T")

log = logging.getLogger("orch.inference")


class UpdateBegan(Exception):
    """update_mode interrupt: a reload began before a streamed completion's first token was back."""


_MAY_PASS = frozenset({404, 408, 409, 429})  # a refused weight load that a later try may get through


@dataclass(eq=False)
class Endpoint:
    url: str
    index: int
    inflight: int = 0
    assigned: int = 0  # requests routed here so far (tie-break)
    completed: int = 0
    failures: int = 0  # consecutive
    total_failures: int = 0
    down_until: float = 0.0  # monotonic; 0 = up
    last_error: str | None = None
    version: int = -1  # newest weight version this endpoint confirmed (-1: unknown)
    error_kinds: dict[str, int] = field(default_factory=dict)  # failure kind -> count
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    # A down endpoint whose backoff ran out is tried by one request, the probe; the others wait
    # for its result instead of each spending an attempt on it.
    probe: asyncio.Future | None = field(default=None, repr=False)
    sending: int = 0  # completion calls sent and not answered yet
    idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set while sending == 0
    # interrupt and keep: calls a reload waits for before it pauses: another route's call
    # (interrupt: its answer would lose what it sampled if aborted; keep: it reports one version)
    # until it returns; interrupt: a completion restarted MAX_RESTARTS times until its first
    # token. An event set while there is none.
    unabortable: int = 0
    abortable: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # interrupt: streamed completions whose first token is not back yet (the engine may not hold
    # them yet, and a pause would keep them for the new weights): a reload ends each of them
    # (its timeout, expired now) and it is sent again once the endpoint resumed.
    unstarted: dict[int, asyncio.Timeout] = field(default_factory=dict, repr=False)
    sync: Any = None  # its weight-sync dialect's state (`WeightSyncDialect.new_state`)
    last_load_error: ServerError | None = None  # its last load's 5xx, if that load failed on one
    # Why its last load missed the load timeout (None: it did not): a server stuck in a load (a
    # push receive that never ends) answers /health all the same; the launcher restarts it.
    missed_load: str | None = None
    connections: asyncio.Semaphore | None = field(default=None, repr=False)  # its origin's cap (None: none)
    # A router's: the engines behind it (their base URLs), which its weight loads go to, each
    # directly; and the header its requests name their group's session in (sticky routing).
    engines: tuple[str, ...] = ()
    session_header: str | None = None

    def __post_init__(self) -> None:
        self.idle.set()
        self.abortable.set()

    @contextlib.contextmanager
    def unabortable_call(self) -> Iterator[Callable[[], None]]:
        """Counts a call in `unabortable` until the callable it gives is called or it ends."""
        counted = True

        def release() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.unabortable -= 1
                if self.unabortable == 0:
                    self.abortable.set()

        self.unabortable += 1
        self.abortable.clear()
        try:
            yield release
        finally:
            release()

    @contextlib.contextmanager
    def unstarted_stream(self, restart: asyncio.Timeout) -> Iterator[Callable[[], None]]:
        """Holds a stream's `restart` timeout in `unstarted` until the callable it gives is
        called (its first token is back) or it ends."""
        key = id(restart)
        self.unstarted[key] = restart
        try:
            yield lambda: self.unstarted.pop(key, None)
        finally:
            self.unstarted.pop(key, None)

    def restart_unstarted(self) -> None:
        """Ends every stream without a first token: it is sent again after the reload."""
        now = asyncio.get_running_loop().time()
        restarts = list(self.unstarted.values())
        self.unstarted.clear()
        for restart in restarts:
            restart.reschedule(now)

    def up(self, now: float) -> bool:
        return now >= self.down_until

    @property
    def admin_urls(self) -> tuple[str, ...]:
        """Where its weights are loaded: a router's engines, else the endpoint itself."""
        return self.engines or (self.url,)

    def sampling_headers(self, session: Any) -> dict[str, str]:
        """A sampling request's headers: a router's name the request's session (its group), so
        that a sticky router sends a group's requests to one engine and its prefix cache."""
        if self.session_header is None or session is None:
            return JSON_HEADERS
        return {**JSON_HEADERS, self.session_header: str(session)}

    def snapshot(self, now: float) -> dict[str, Any]:
        # "up": the last contact succeeded; a failing endpoint is probed again after retry_in_s
        return {
            "url": self.url,
            "up": self.failures == 0,
            "retry_in_s": round(max(0.0, self.down_until - now), 3),
            "inflight": self.inflight,
            "assigned": self.assigned,
            "completed": self.completed,
            "failures": self.total_failures,
            "version": self.version,
            "error_kinds": dict(self.error_kinds),
            "last_error": self.last_error,
        }


@dataclass(frozen=True)
class Completion:
    endpoint: str  # the one that answered (the last one, for a continued choice)
    choices: list[ParsedChoice]
    policy_start: int  # version the samples came from (exact when the server reports it)
    policy_end: int
    attempts: int
    # interrupt or keep, for a completion continued across a reload: each choice's `token_versions`
    # (runs, `orchestrator.core.events.version_runs`: empty where one version sampled all of
    # it) and its oldest and newest token's versions (`choice_policy`)
    choice_versions: tuple[tuple[tuple[int, int], ...], ...] = ()
    choice_policies: tuple[tuple[int, int], ...] = ()

    def choice_policy(self, index: int) -> tuple[int, int]:
        """The versions of choice `index`'s oldest and newest tokens."""
        return self.choice_policies[index] if self.choice_policies else (self.policy_start, self.policy_end)


@dataclass(frozen=True)
class Generated:
    """A :meth:`InferenceClient.generate` call as the endpoint answered it."""

    endpoint: str
    answer: Any  # the endpoint's JSON answer, untouched
    policy_start: int
    policy_end: int
    attempts: int
    http_s: float  # the answering attempt's HTTP exchange, weight sync included


class InferenceClient:
    def __init__(
        self,
        urls: list[str],
        *,
        model: str | None = None,
        weight_sync: str = "orch",
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        load_timeout_s: float = 300.0,
        max_attempts: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        pin_groups: bool = True,
        max_connections: int | None = None,
        max_connections_per_endpoint: int | None = None,
        max_loras: int = 2,
        update_mode: UpdateMode = "wait",
        stream_interval: int = STREAM_INTERVAL,
        routers: Sequence[RouterSection] = (),
    ):
        urls = [*urls, *(router.url for router in routers)]
        if not urls:
            raise ValueError("InferenceClient needs at least one endpoint URL")
        if max_attempts < 1 or timeout_s <= 0 or connect_timeout_s <= 0 or backoff_s <= 0:
            raise ValueError("max_attempts >= 1 and positive timeouts/backoff are required")
        self.dialect = DIALECTS[weight_sync]
        self.endpoints = [
            Endpoint(url, i, sync=self.dialect.new_state()) for i, url in enumerate(endpoint_base_urls(urls))
        ]
        for ep, router in zip(self.endpoints[len(urls) - len(routers) :], routers, strict=True):
            ep.engines = tuple(endpoint_base_urls(router.engines))
            ep.session_header = router.session_header
        self.model, self.weight_sync = model, weight_sync
        if update_mode not in self.dialect.update_modes:
            offered = names_where(lambda dialect: update_mode in dialect.update_modes)
            raise ValueError(f"update_mode {update_mode!r} needs weight_sync {offered}, not {weight_sync!r}")
        self.update_mode = update_mode
        if stream_interval < 1:
            raise ValueError("stream_interval >= 1 (tokens per streamed chunk)")
        self.stream_interval = stream_interval
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self.pin_groups = pin_groups
        if max_loras < 2:
            raise ValueError("max_loras >= 2: the adapter being replaced stays loaded while its requests finish")
        self.max_loras = max_loras
        self.target: tuple[int, str] | None = None  # (version, weights dir) every endpoint should hold
        self._pins: OrderedDict[Any, Endpoint] = OrderedDict()
        self._ids = itertools.count()
        for name, cap in (
            ("max_connections", max_connections),
            ("max_connections_per_endpoint", max_connections_per_endpoint),
        ):
            if cap is not None and cap < 1:
                raise ValueError(f"{name} >= 1 (or None: no cap)")
        # Each endpoint's (origin's) connections in pools of their own, sharded (.pool: the
        # pool's per-request cost grows with its connections). Idle connections are dropped well
        # before the servers' keep-alive timeout (vLLM's and uvicorn's: 5 s, httpx's default
        # expiry too), so none is reused as the server closes it (a ReadError, a retry, and the
        # endpoint marked down for a backoff).
        origins = {ep: _origin(ep.url) for ep in self.endpoints}
        distinct = list(dict.fromkeys(origins.values()))
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            trust_env=False,
            transport=ByOrigin(
                {origin: ShardedTransport(lambda: _transport(None)) for origin in distinct}, _transport(None)
            ),
        )
        # The caps, as slots a connection is taken with: per endpoint (origin) and in all.
        per_endpoint = {
            origin: asyncio.Semaphore(max_connections_per_endpoint) if max_connections_per_endpoint else None
            for origin in distinct
        }
        for ep, origin in origins.items():
            ep.connections = per_endpoint[origin]
        self._all_connections = asyncio.Semaphore(max_connections) if max_connections is not None else None
        self._connect_timeout_s = connect_timeout_s
        self._stream_session: aiohttp.ClientSession | None = None  # `_streams`
        self._pacer = StartPacer()  # a reload's wave of continuations spread over loop steps
        self.lag = LoopLag(keep_s=max(timeout_s, connect_timeout_s))  # the windows `_transport_errors` asks about
        self.retries = 0  # requests re-sent after a failure (all endpoints together)
        self.lag_retries = 0  # requests sent again after a failure on orch's side (Retryable.orch_side)

    def _streams(self) -> aiohttp.ClientSession:
        """The HTTP client of streamed completions, made on the running loop at the first stream.
        aiohttp rather than httpx: its per-request cost is a fraction of httpx's (bench/README.md,
        "streamed tokens"), and a stream is one request per completion and per continuation.
        Connections: no cap of its own (the client's slots cap them), idle ones dropped at
        KEEPALIVE_S, as httpx's."""
        if self._stream_session is None:
            self._stream_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, ssl=_ssl_context()),
                timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s, sock_read=self.timeout_s),
                trust_env=False,
                skip_auto_headers=("Accept-Encoding",),  # the stream as the server writes it
            )
        return self._stream_session

    async def aclose(self) -> None:
        self.lag.stop()
        session, self._stream_session = self._stream_session, None
        try:
            await self._http.aclose()
        finally:
            if session is not None:
                await session.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [e.snapshot(now) for e in self.endpoints]

    def report(self) -> str:
        """One line per endpoint: completions, failures by kind, state; then the re-sent count."""
        parts = []
        for s in self.status():
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(s["error_kinds"].items()))
            parts.append(
                f"{s['url']}: {s['completed']} completions, {s['failures']} failures"
                + (f" ({kinds})" if kinds else "")
                + ("" if s["up"] else ", down")
            )
        return "; ".join(parts) + f"; {self.retries} requests re-sent after a failure"

    # -- routing and health -----------------------------------------------------------------------
    def pick(self, pin: Any = None, avoid: frozenset[Endpoint] = frozenset()) -> Endpoint | None:
        """The endpoint for the next request (None when every endpoint is down)."""
        now = time.monotonic()
        up = [e for e in self.endpoints if e.up(now) and e.probe is None]
        if not up:
            return None
        preferred = [e for e in up if e not in avoid] or up
        if pin is not None and self.pin_groups:
            pinned = self._pins.get(pin)
            if pinned is not None and pinned in preferred:
                self._pins.move_to_end(pin)
                return pinned
        best = min(preferred, key=lambda e: (e.inflight, e.assigned, e.index))
        if pin is not None and self.pin_groups:
            self._pins[pin] = best
            self._pins.move_to_end(pin)
            while len(self._pins) > MAX_PINS:
                self._pins.popitem(last=False)
        return best

    def mark_down(self, ep: Endpoint, error: str, kind: str = "error") -> None:
        if ep.failures == 0:  # said once per outage, not at every failed probe
            log.warning("orch: inference endpoint %s marked down (%s); requests go to the others", ep.url, error)
        now = time.monotonic()
        if ep.up(now):  # the backoff doubles per failed probe, not per request that was in flight
            ep.failures += 1
            ep.down_until = now + min(self.max_backoff_s, self.backoff_s * 2 ** (ep.failures - 1))
        ep.total_failures += 1
        ep.error_kinds[kind] = ep.error_kinds.get(kind, 0) + 1
        ep.last_error = error
        ep.version = -1  # unknown after a failure: it may come back as a fresh process

    def mark_up(self, ep: Endpoint) -> None:
        if ep.failures:
            log.warning("orch: inference endpoint %s is back up", ep.url)
        ep.failures = 0
        ep.down_until = 0.0

    async def _wait_for_an_endpoint(self, at_most_s: float) -> None:
        """Until a probe ends or the first backoff runs out, at most ``at_most_s`` (cancellable)."""
        now = time.monotonic()
        probes = [e.probe for e in self.endpoints if e.probe is not None]
        backoffs = [e.down_until for e in self.endpoints if e.probe is None]
        delay = min(max(0.0, min(backoffs) - now) if backoffs else at_most_s, at_most_s)
        if probes:
            await asyncio.wait(probes, timeout=delay)
        else:
            await asyncio.sleep(delay)

    # -- HTTP -------------------------------------------------------------------------------------
    async def call(
        self,
        ep: Endpoint,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        text: bool = False,
        *,
        base: str | None = None,
        headers: dict[str, str] = JSON_HEADERS,
    ) -> Any:
        """One HTTP call to ``ep`` (or to ``base``, one of its engines); transport errors and 5xx
        -> Retryable, 4xx -> InferenceRequestError. The answer's JSON, or its text with ``text``
        (vLLM's LoRA routes answer in plain text)."""
        url = (base or ep.url) + path
        # orjson both ways: the sampling calls' bodies and answers are the client's hot path.
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs.update(content=orjson.dumps(body), headers=headers)
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=self._http.timeout.connect)
        async with self._connection_slot(ep, method, url, path):
            with self._transport_errors(method, url, path, timeout):
                resp = await self._http.request(method, url, **kwargs)
        if resp.status_code >= 400:
            _raise_for_status(resp.status_code, resp.content, resp.reason_phrase, method, url, path)
        if text:
            return resp.text
        return _json_answer(resp.content, method, url, path)

    async def _post_kept(self, ep: Endpoint, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """``POST path`` unstreamed (update_mode keep), over the streams' HTTP client: aiohttp's
        per-request cost is a fraction of httpx's, and keep sends one request per completion."""
        url = ep.url + path
        with self._transport_errors("POST", url, path):
            async with (
                self._connection_slot(ep, "POST", url, path),
                self._streams().post(url, data=orjson.dumps(body), headers=headers, allow_redirects=False) as resp,
            ):
                content = await resp.read()
        if resp.status >= 400:
            _raise_for_status(resp.status, content, resp.reason or "", "POST", url, path)
        return _json_answer(content, "POST", url, path)

    async def _stream(
        self, ep: Endpoint, path: str, body: dict[str, Any], restarts: int, headers: dict[str, str]
    ) -> dict[str, Any]:
        """``POST path`` streamed (update_mode interrupt): the chunks gathered into the answer an
        unstreamed call gives, so that an aborted request comes back with every token it was
        sent (vLLM's unstreamed answer to an aborted request holds only its last one). A reload
        that begins before its first token is back ends it (`UpdateBegan`: whatever it sampled is
        dropped, and it is sent again after the reload), so that the pause aborts every request
        it leaves running instead of holding one for the new weights; after `restarts` reached
        MAX_RESTARTS, a reload waits for its first token instead (docs/vllm.md, "Weight updates
        while requests run")."""
        url = ep.url + path
        choices: dict[int, _StreamedChoice] = {}
        request = {**body, "stream": True}
        if self.stream_interval > 1:
            request["stream_interval"] = self.stream_interval
        content = orjson.dumps(request)
        events = EventStreamDecoder()
        until_started = ep.unstarted_stream if restarts < MAX_RESTARTS else _waited_for(ep)
        try:
            async with asyncio.timeout(None) as restart:
                with until_started(restart) as started, self._transport_errors("POST", url, path):
                    await self._pacer.turn()  # registered first: a reload meanwhile ends it as unstarted
                    async with (
                        self._connection_slot(ep, "POST", url, path),
                        self._streams().post(url, data=content, headers=headers, allow_redirects=False) as resp,
                    ):
                        if resp.status >= 400:
                            _raise_for_status(resp.status, await resp.read(), resp.reason or "", "POST", url, path)
                        async for read in resp.content.iter_any():
                            for data in events.feed(read):
                                if data == b"[DONE]":
                                    continue
                                started()
                                try:
                                    chunk = orjson.loads(data)
                                except ValueError:
                                    raise Retryable(
                                        f"POST {url}: a streamed chunk is not JSON", f"not JSON {path}"
                                    ) from None
                                if isinstance(chunk, dict) and "error" in chunk:  # unstreamed: an HTTP error
                                    _raise_for_stream_error(chunk["error"], url, path)
                                try:
                                    _add_chunk(choices, chunk)
                                except ProtocolError as exc:
                                    raise InferenceRequestError(f"{url}: {exc}") from None
        except TimeoutError:
            if restart.expired():
                raise UpdateBegan from None
            raise
        if any(c.finish_reason is None for c in choices.values()):
            raise Retryable(f"POST {url}: the stream ended before its choices did", f"stream cut {path}")
        return {"choices": [choices[i].answer() for i in sorted(choices)]}

    @contextlib.asynccontextmanager
    async def _connection_slot(self, ep: Endpoint, method: str, url: str, path: str) -> AsyncIterator[None]:
        """A slot of each connection cap (`max_connections_per_endpoint`, `max_connections`)
        held for one HTTP exchange; waited for at most the request timeout. A wait that runs
        out is orch's own limit, not the endpoint's failure (`Retryable.orch_side`)."""
        caps = [cap for cap in (ep.connections, self._all_connections) if cap is not None]
        if not caps:
            yield
            return
        taken: list[asyncio.Semaphore] = []
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    for cap in caps:
                        await cap.acquire()
                        taken.append(cap)
            except TimeoutError:
                raise Retryable(
                    f"{method} {url}: no connection free within {self.timeout_s:g}s "
                    "(inference.openai.max_connections or max_connections_per_endpoint reached)",
                    f"connection cap {path}",
                    orch_side=True,
                ) from None
            yield
        finally:
            for cap in taken:
                cap.release()

    @contextlib.contextmanager
    def _transport_errors(self, method: str, url: str, path: str, timeout: float | None = None) -> Iterator[None]:
        """A transport failure or a timeout of an HTTP exchange, as the Retryable it is. A
        timeout whose window orch's own loop was stalled through (`LoopLag.caused`), or a wait
        for a free pooled connection (httpx's pool timeout), is orch's side."""
        self.lag.watch()
        try:
            yield
        except httpx.TimeoutException as exc:
            connect, pool_wait = isinstance(exc, httpx.ConnectTimeout), isinstance(exc, httpx.PoolTimeout)
            raise self._timed_out(method, url, path, type(exc).__name__, connect, timeout, pool_wait) from None
        except aiohttp.ServerTimeoutError as exc:  # a streamed completion's connect or read
            connect = isinstance(exc, aiohttp.ConnectionTimeoutError)
            kind = "ConnectTimeout" if connect else "ReadTimeout"
            raise self._timed_out(method, url, path, kind, connect, timeout) from None
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            kind = next((_AIOHTTP_KINDS[t] for t in type(exc).__mro__ if t in _AIOHTTP_KINDS), type(exc).__name__)
            raise Retryable(f"{method} {url}: {kind}: {exc or 'connection failed'}", f"{kind} {path}") from None

    def _timed_out(
        self, method: str, url: str, path: str, kind: str, connect: bool, timeout: float | None, pool_wait: bool = False
    ) -> Retryable:
        """A timed-out exchange (either HTTP client's): orch's side if orch's own loop stalled
        through its window, or if it waited for a pooled connection."""
        own_lag = self.lag.caused((self._connect_timeout_s or self.timeout_s) if connect else timeout or self.timeout_s)
        cause = " while orch's event loop stalled" if own_lag else ""
        return Retryable(
            f"{method} {url}: timed out ({kind}){cause}",
            f"{kind} {path}",
            orch_side=own_lag or pool_wait,
            stalled=own_lag,
            timed_out=True,
        )

    # -- completions ------------------------------------------------------------------------------
    async def complete(
        self,
        prompt: str | list[int],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int = 16,
        seed: int | None = None,
        pin: Any = None,
        extra: dict[str, Any] | None = None,
        at_version: int | None = None,
    ) -> Completion:
        """Sample ``n`` completions of ``prompt`` (text or token ids) with token ids and logprobs.

        Retried on another endpoint after a transport/server failure (at most ``max_attempts``
        attempts); the same ``seed`` is sent each time. ``at_version`` (an eval pinned to it): with
        ``vllm_lora`` the adapter of that version is asked for while the endpoint holds it (adapters
        are immutable, one per version; unused old ones are unloaded); the other modes sample with
        the weights the endpoint holds.
        The completion reports the version that sampled it either way.
        """
        body: dict[str, Any] = {
            "prompt": prompt,
            "n": n,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if extra:
            body.update(extra)
        expected = n * (len(prompt) if _is_batch(prompt) else 1)
        if self.update_mode == "keep":
            return await self._complete_kept(body, expected, at_version, pin)
        ep, (choices, sampled_by, ended_at), attempts = await self.routed(
            self._completion_sender(body, expected, at_version, pin), pin, "completion"
        )
        if self.update_mode != "interrupt" or not any(c.finish_reason == "abort" for c in choices):
            return Completion(ep.url, choices, sampled_by, ended_at, attempts)
        # interrupt: a reload aborted some choices; each is continued with the new weights
        # gathered, not a TaskGroup: a drain's cancel then stays a cancel (Python 3.11's TaskGroup
        # folds it into a child's error), and a failed part is the request's failure
        results = await asyncio.gather(
            *(self._continue(c, i, sampled_by, body, pin) for i, c in enumerate(choices)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        done = [r for r in results if not isinstance(r, BaseException)]
        return _segmented(
            done[-1][2] or ep.url,
            [c for c, _segments, _e, _a in done],
            [segments for _c, segments, _e, _a in done],
            sampled_by,
            attempts + sum(a for _c, _r, _e, a in done),
        )

    async def _complete_kept(self, body: dict[str, Any], expected: int, at_version: int | None, pin: Any) -> Completion:
        """`complete` in update_mode keep: the completions body as a request of vLLM's token-in,
        token-out route, whose answer says which weight version sampled each token (a load in
        between froze the request, and the engine continued it with the new weights)."""
        prompt = body["prompt"]
        if _is_batch(prompt) or not isinstance(prompt, list):
            raise InferenceRequestError(f"update_mode keep samples one prompt of token ids ({GENERATE_PATH})")
        skipped = ("prompt", "return_tokens_as_token_ids", "return_token_ids")
        request = {
            "token_ids": prompt,
            "sampling_params": {key: value for key, value in body.items() if key not in skipped},
            "output_mode": "text",
            "return_token_ids": True,  # the prompt's ids, as vLLM saw them
        }

        async def send(ep: Endpoint) -> tuple[list[ParsedChoice], list[list[tuple[int, int]]], int]:
            answer, sent_at, _ = await self._post_sampling(ep, GENERATE_PATH, request, at_version, pin, kept=True)
            where = f"{ep.url}{GENERATE_PATH}"
            try:
                parsed = parse_generated(answer, expected, where)
                return [c for c, _ in parsed], [_token_versions(spans, sent_at, where) for _, spans in parsed], sent_at
            except ProtocolError as exc:
                raise InferenceRequestError(str(exc)) from None

        ep, (choices, runs, sent_at), attempts = await self.routed(send, pin, "completion")
        return _segmented(ep.url, choices, runs, sent_at, attempts)

    def _completion_sender(
        self, body: dict[str, Any], expected: int, at_version: int | None, pin: Any
    ) -> Callable[[Endpoint], Awaitable[tuple[list[ParsedChoice], int, int]]]:
        """One attempt of a completion call on an endpoint (for `routed`): its parsed choices,
        the version that sampled them and the one known when they came back."""

        async def send(ep: Endpoint) -> tuple[list[ParsedChoice], int, int]:
            answer, sampled_by, ended_at = await self._post_sampling(ep, "/v1/completions", body, at_version, pin)
            try:
                choices, reported = parse_completion(answer, expected, where=f"{ep.url}/v1/completions")
            except ProtocolError as exc:
                raise InferenceRequestError(str(exc)) from None
            if reported is not None:  # the server says which version sampled it (`orch serve`)
                return choices, reported, reported
            return choices, sampled_by, ended_at

        return send

    async def _continue(
        self, choice: ParsedChoice, index: int, version: int, body: dict[str, Any], pin: Any
    ) -> tuple[ParsedChoice, list[tuple[int, int]], str | None, int]:
        """A choice that a reload aborted, continued until it ends: prompt + what it has so far
        as the prompt, `max_tokens` (and `min_tokens`) reduced by it, the seed derived
        (`continuation_seed`), on any endpoint, as often as reloads abort it. (The whole
        choice, its (version, tokens) segments, the endpoint of its last part, the attempts.)"""
        segments = [(version, len(choice.token_ids))]
        if choice.finish_reason != "abort":
            return choice, segments, None, 0
        if choice.prompt_ids is None:
            raise InferenceRequestError("an interrupted completion came back without its prompt_token_ids")
        ids, logprobs, text, finish = list(choice.token_ids), list(choice.logprobs), choice.text, "abort"
        endpoint, attempts = None, 0
        while finish == "abort" and len(ids) < body["max_tokens"]:
            part_body = {**body, "prompt": choice.prompt_ids + ids, "n": 1, "max_tokens": body["max_tokens"] - len(ids)}
            if "seed" in body:
                part_body["seed"] = continuation_seed(body["seed"], index, len(ids))
            if "min_tokens" in body:
                part_body["min_tokens"] = max(0, body["min_tokens"] - len(ids))
            ep, ((part,), sampled_by, _ended), tries = await self.routed(
                self._completion_sender(part_body, 1, None, pin), pin, "continued completion"
            )
            segments.append((sampled_by, len(part.token_ids)))
            ids += part.token_ids
            logprobs += part.logprobs
            text += part.text
            finish = part.finish_reason
            endpoint, attempts = ep.url, attempts + tries
        whole = ParsedChoice(choice.prompt_ids, ids, logprobs, text, "length" if finish == "abort" else finish)
        return whole, segments, endpoint, attempts

    async def generate(
        self, path: str, body: dict[str, Any], *, pin: Any = None, at_version: int | None = None
    ) -> Generated:
        """One sampling call of another route than ``/v1/completions`` (vLLM's token-in/token-out
        ``/inference/v1/generate``, which verifiers' train client posts), its JSON body and answer
        passed through as they are: the same routing, retries, weight versions, eval pin
        (``at_version``) and cancellation as :meth:`complete`; the request names the model (or
        the version's adapter) as there."""

        async def send(ep: Endpoint) -> tuple[Any, int, int, float]:
            sent = time.perf_counter()
            answer, sampled_by, ended_at = await self._post_sampling(ep, path, body, at_version, pin)
            return answer, sampled_by, ended_at, time.perf_counter() - sent

        ep, (answer, sampled_by, ended_at, http_s), attempts = await self.routed(send, pin, f"POST {path}")
        return Generated(ep.url, answer, sampled_by, ended_at, attempts, http_s)

    async def models(self) -> Any:
        """``GET /v1/models`` of the first endpoint that answers (InferenceUnavailable if none does)."""
        errors = []
        for ep in self.endpoints:
            try:
                return await self.call(ep, "GET", "/v1/models")
            except (Retryable, InferenceRequestError) as exc:
                errors.append(str(exc))
        raise InferenceUnavailable("no inference endpoint answered GET /v1/models: " + "; ".join(errors))

    async def routed(self, send: Callable[[Endpoint], Awaitable[T]], pin: Any, what: str) -> tuple[Endpoint, T, int]:
        """``send(endpoint)`` with the client's routing and retries: (the endpoint that answered,
        what ``send`` returned, attempts). ``send`` raises ``Retryable`` on a transport or server
        failure (the endpoint is marked down, the next attempt goes to another) and
        InferenceRequestError on a request the endpoint refused (raised at once). A failure on
        orch's side (``Retryable.orch_side``: its stalled loop, its connection cap) is no attempt
        and marks nothing down: the request is sent again, for at most ``timeout_s`` after the
        first such failure. A stalled loop is given that once per endpoint: the next failure
        there counts as the endpoint's (a dead endpoint on a loaded machine would otherwise hold
        a pinned request until the bound, and fail it, instead of trying another)."""
        errors: list[str] = []
        tried: set[Endpoint] = set()
        server_errors: dict[Endpoint, ServerError | None] = {}  # this request's last failure of each
        attempt = 0
        waiting_since: float | None = None
        orch_side_since: float | None = None
        stalled_on: set[Endpoint] = set()  # endpoints a failure of this request was put down to a stall on
        while True:
            ep = self.pick(pin, frozenset(tried))
            if ep is None:  # all down: wait (cancellable) for the first backoff to expire, or a probe
                now = time.monotonic()
                waiting_since = now if waiting_since is None else waiting_since
                if now - waiting_since >= self.timeout_s:  # as long as the request itself may take
                    raise InferenceUnavailable(
                        f"every inference endpoint down for {now - waiting_since:.0f}s: "
                        + "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints)
                    ) from None
                await self._wait_for_an_endpoint(waiting_since + self.timeout_s - now)
                continue
            waiting_since = None
            attempt += 1
            if attempt > 1:
                self.retries += 1
            probing = ep.failures > 0
            if probing:
                ep.probe = asyncio.get_running_loop().create_future()
            ep.inflight += 1
            ep.assigned += 1
            try:
                result = await send(ep)
            except Retryable as exc:
                if exc.orch_side and not (exc.stalled and ep in stalled_on):
                    if exc.stalled:
                        stalled_on.add(ep)
                    now = time.monotonic()
                    orch_side_since = now if orch_side_since is None else orch_side_since
                    if now - orch_side_since >= self.timeout_s:
                        raise InferenceUnavailable(
                            f"{what}: orch's own side failed it for {now - orch_side_since:.0f}s: {exc.message}"
                        ) from None
                    attempt -= 1
                    self.lag_retries += 1
                    continue
                if same_server_error_again(server_errors.get(ep), exc.server_error):
                    raise exc.permanent() from None
                server_errors[ep] = exc.server_error
                if not exc.counted:
                    self.mark_down(ep, exc.message, exc.kind)
                errors.append(exc.message)
                tried.add(ep)
                if attempt >= self.max_attempts:
                    raise InferenceUnavailable(
                        f"{what} failed after {attempt} attempt(s) on {len(tried)} endpoint(s): " + "; ".join(errors)
                    ) from None
                continue
            finally:
                ep.inflight -= 1
                if probing:  # succeeded, failed or cancelled: the waiting requests look again
                    ep.probe.set_result(None)
                    ep.probe = None
            self.mark_up(ep)
            ep.completed += 1
            return ep, result, attempt

    async def _post_sampling(
        self, ep: Endpoint, path: str, body: dict[str, Any], at_version: int | None, pin: Any, *, kept: bool = False
    ) -> tuple[Any, int, int]:
        """One sampling call (``POST path``) on ``ep`` at its newest version (vllm_lora: at
        ``at_version`` while the endpoint still holds its adapter): (the answer's JSON, version
        that sampled it, version known when it came back). A router's requests name ``pin``
        (the group) as their session, where groups are pinned. ``kept``: a completion of
        update_mode keep, which a load freezes and the engine continues (its answer says each
        token's version)."""
        headers = ep.sampling_headers(pin if self.pin_groups else None)
        version, model = self.dialect.sample_with(self, ep, await self._ensure_version(ep), at_version)
        request = dict(body)
        if model is not None:
            request["model"] = model
        restarts = 0
        while True:
            await self.dialect.before_attempt(self, ep)
            try:
                return await self._sampling_attempt(ep, path, request, version, restarts, headers, kept)
            except UpdateBegan:  # interrupt: ended by a reload before its first token
                restarts += 1

    async def _sampling_attempt(
        self,
        ep: Endpoint,
        path: str,
        request: dict[str, Any],
        version: int,
        restarts: int,
        headers: dict[str, str],
        kept: bool,
    ) -> tuple[Any, int, int]:
        """`_post_sampling`'s call on ``ep`` at ``version``, once its dialect let it be sent."""
        start_version = self.dialect.known_version(self, ep)
        ep.sending += 1
        ep.idle.clear()
        try:
            with self.dialect.in_flight(ep, version):
                if kept:
                    answer = await self._post_kept(ep, path, request, headers)
                elif self.update_mode == "wait":
                    answer = await self.call(ep, "POST", path, request, headers=headers)
                elif self.update_mode == "interrupt" and path == "/v1/completions":
                    answer = await self._stream(ep, path, request, restarts, headers)
                else:  # another route's call (verifiers' /inference/v1/generate): a load waits for it
                    with ep.unabortable_call():
                        answer = await self.call(ep, "POST", path, request, headers=headers)
        finally:
            ep.sending -= 1
            if ep.sending == 0:
                ep.idle.set()
        return answer, *self.dialect.answer_versions(self, ep, version, start_version)

    # -- weights ----------------------------------------------------------------------------------
    async def load(self, version: int, path: str) -> dict[str, int | str]:
        """Tell every endpoint to load ``path`` as ``version``; returns url -> confirmed version or
        the error. Raises :class:`InferenceError` if no endpoint confirmed it. Endpoints that
        failed are marked down and brought up to date before they serve again."""
        before = self.target
        if self.target is None or version >= self.target[0]:
            self.target = (version, path)
        if not self.dialect.loads:
            return {e.url: version for e in self.endpoints}
        results = await asyncio.gather(
            *(self._load_one(e, version, path) for e in self.endpoints), return_exceptions=True
        )
        answers: dict[str, int | str] = {}
        for ep, res in zip(self.endpoints, results):
            if isinstance(res, BaseException):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                answers[ep.url] = f"{type(res).__name__}: {res}"
            else:
                answers[ep.url] = res
        if not any(isinstance(v, int) and v >= version for v in answers.values()):
            # Every endpoint refused the load itself for good (a malformed request or answer, no
            # permission): asking again will not help, so the caller fails at once rather than at
            # its timeout. A 404/409/408/429 may pass (weights not yet visible to the server).
            refused = all(
                isinstance(res, InferenceRequestError) and res.status_code not in _MAY_PASS for res in results
            )
            if refused and self.target == (version, path):
                self.target = before  # a version no endpoint can load is no load's target
            raise (InferenceRequestError if refused else InferenceError)(
                f"no inference endpoint confirmed weights version {version} ({path}): "
                + "; ".join(f"{u}: {a}" for u, a in answers.items())
            )
        return answers

    async def _load_one(self, ep: Endpoint, version: int, path: str) -> int:
        async with ep.sync_lock:
            # A load queued behind a slow one goes to the newest version: an older one's dir may
            # be pruned by now, and the endpoint would only have to load again.
            if self.target is not None and self.target[0] > version:
                version, path = self.target
            if ep.version >= version:
                return ep.version
            try:
                confirmed = await self.dialect.load(self, ep, version, path)
            except Retryable as exc:
                # an endpoint's loads run one at a time (its sync_lock): their retries are one loop
                if same_server_error_again(ep.last_load_error, exc.server_error):
                    raise exc.permanent() from None
                ep.last_load_error = exc.server_error
                if exc.timed_out and not exc.orch_side:
                    ep.missed_load = f"did not load version {version} within {self.load_timeout_s:g}s ({exc.message})"
                self.mark_down(ep, exc.message, exc.kind)
                raise InferenceUnavailable(exc.message) from None
            ep.last_load_error, ep.missed_load = None, None
            ep.version = max(ep.version, confirmed)
            self.mark_up(ep)
            return ep.version

    async def _ensure_version(self, ep: Endpoint) -> int:
        """Before a request: bring ``ep`` to the target version if it has not confirmed it.

        A load that the endpoint refuses (e.g. the weights dir was already pruned) is not fatal if
        the endpoint holds some version: it samples with that one and reports it."""
        if self.target is None or not self.dialect.loads:
            return self.dialect.known_version(self, ep)
        version, path = self.target
        if ep.version >= version:
            return ep.version
        try:
            return await self._load_one(ep, version, path)
        except InferenceUnavailable as exc:
            raise Retryable(str(exc), "weight sync", counted=True) from None
        except InferenceRequestError:
            if ep.version >= 0:
                return ep.version
            raise


def _raise_for_status(status: int, body: bytes, reason: str, method: str, url: str, path: str) -> None:
    """5xx -> Retryable (the endpoint's fault), 4xx -> InferenceRequestError (the request's)."""
    if status >= 500:
        error = (status, path, _error_message(body, reason))
        raise Retryable(f"{method} {url}: HTTP {error[0]}: {error[2]}", f"HTTP {error[0]} {path}", server_error=error)
    if status >= 400:
        raise InferenceRequestError(f"{method} {url}: HTTP {status}: {_error_message(body, reason)}", status)


def _json_answer(content: bytes, method: str, url: str, path: str) -> Any:
    try:
        return orjson.loads(content)
    except ValueError:
        pass
    try:  # NaN or Infinity, which orjson refuses: parsed, so the answer's check names the value
        return json.loads(content)
    except ValueError:
        raise Retryable(f"{method} {url}: the answer is not JSON", f"not JSON {path}") from None


def _token_versions(spans: tuple[tuple[str, int], ...], sent_at: int, where: str) -> list[tuple[int, int]]:
    """A kept completion's (version, tokens) runs from the engine's labelled spans: orch labels
    each version it loads with its number; the label of a server's weights before any (vLLM's
    "default") is the version the request was sent at, and only its first tokens can have it."""
    runs: list[tuple[int, int]] = []
    for k, (label, tokens) in enumerate(spans):
        if label.isdecimal():
            version = int(label)
        elif k == 0:
            version = sent_at
        else:
            raise ProtocolError(f"{where}: tokens sampled by weights labelled {label!r}, a version orch did not load")
        if runs and version < runs[-1][0]:
            raise ProtocolError(f"{where}: weight versions {spans!r} go back")
        runs.append((version, tokens))
    return runs


def _raise_for_stream_error(error: Any, url: str, path: str) -> None:
    """An error a stream sent in place of a chunk, as `_raise_for_status` would take the HTTP
    status it has unstreamed (its ``code``): 5xx (or none) the endpoint's fault, 4xx the request's."""
    code = error.get("code") if isinstance(error, dict) else None
    message = str(error.get("message", error) if isinstance(error, dict) else error)[:500]
    if isinstance(code, int) and 400 <= code < 500:
        raise InferenceRequestError(f"POST {url}: HTTP {code} (streamed): {message}", code)
    status = code if isinstance(code, int) else 500
    raise Retryable(
        f"POST {url}: the stream failed: {message}", f"stream error {path}", server_error=(status, path, message)
    )


class _StreamedChoice:
    """A streamed choice's chunks gathered (text as its parts, joined once at the end: no copy
    of the text so far per chunk)."""

    __slots__ = ("index", "text", "token_ids", "token_logprobs", "tokens", "finish_reason", "prompt_token_ids")

    def __init__(self, index: Any) -> None:
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[Any] = []
        self.token_logprobs: list[Any] = []
        self.tokens: list[Any] = []
        self.finish_reason: Any = None
        self.prompt_token_ids: Any = None

    def answer(self) -> dict[str, Any]:
        """The choice as an unstreamed answer holds it."""
        choice = {
            "index": self.index,
            "text": "".join(self.text),
            "token_ids": self.token_ids,
            "logprobs": {"token_logprobs": self.token_logprobs, "tokens": self.tokens},
            "finish_reason": self.finish_reason,
        }
        if self.prompt_token_ids is not None:
            choice["prompt_token_ids"] = self.prompt_token_ids
        return choice


def _add_chunk(choices: dict[int, _StreamedChoice], chunk: dict[str, Any]) -> None:
    """A streamed completion chunk added to the choices gathered so far (each as an unstreamed
    answer's choice: text, token ids and logprobs concatenated, the last finish_reason)."""
    for part in chunk.get("choices") or ():
        if not isinstance(part, dict):
            raise ProtocolError("a streamed chunk's choice is not an object")
        index = part.get("index", 0)
        whole = choices.get(index)
        if whole is None:
            whole = choices[index] = _StreamedChoice(index)
        if text := part.get("text"):
            whole.text.append(text)
        whole.token_ids.extend(part.get("token_ids") or ())
        if block := part.get("logprobs"):
            whole.token_logprobs.extend(block.get("token_logprobs") or ())
            whole.tokens.extend(block.get("tokens") or ())
        whole.finish_reason = part.get("finish_reason") or whole.finish_reason
        if part.get("prompt_token_ids") is not None:
            whole.prompt_token_ids = part["prompt_token_ids"]


def _segmented(
    endpoint: str, choices: list[ParsedChoice], segments: list[list[tuple[int, int]]], sent_at: int, attempts: int
) -> Completion:
    """A completion whose choices' tokens came in (version, tokens) segments (interrupt's parts,
    keep's spans): each choice's runs and oldest and newest versions, and the whole's."""
    # a part aborted before its first token sampled nothing: its version is no token's
    policies = [_oldest_and_newest(parts, sent_at) for parts in segments]
    return Completion(
        endpoint,
        choices,
        min(start for start, _ in policies),
        max(end for _, end in policies),
        attempts,
        tuple(version_runs(parts) for parts in segments),
        tuple(policies),
    )


def _oldest_and_newest(segments: list[tuple[int, int]], sent_at: int) -> tuple[int, int]:
    """The versions of a continued choice's oldest and newest tokens (`sent_at` for one without any)."""
    versions = [version for version, count in segments if count] or [sent_at]
    return min(versions), max(versions)


def _waited_for(ep: Endpoint) -> Callable[[asyncio.Timeout], contextlib.AbstractContextManager[Callable[[], None]]]:
    """`Endpoint.unstarted_stream`'s stand-in for a stream restarted MAX_RESTARTS times: a
    reload waits for its first token (`unabortable`) instead of ending it."""
    return lambda _restart: ep.unabortable_call()


def continuation_seed(seed: int, choice: int, tokens_so_far: int) -> int:
    """The seed of an interrupted choice's continuation: a function of the request's seed, the
    choice and where it resumes, so a re-run continues the same way (docs/vllm.md)."""
    digest = hashlib.blake2b(b"%d/%d/%d" % (seed, choice, tokens_so_far), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# aiohttp's failures named as httpx names the same ones, so that an endpoint's error kinds read
# alike whichever client met them (`Endpoint.error_kinds`).
_AIOHTTP_KINDS = {
    aiohttp.ClientConnectorError: "ConnectError",
    aiohttp.ServerDisconnectedError: "RemoteProtocolError",
    aiohttp.ClientPayloadError: "ReadError",
    aiohttp.ClientOSError: "ReadError",
}


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """The TLS settings every pool shares: httpx builds a context per transport otherwise, which
    takes milliseconds of the event loop each time a shard is made (.pool)."""
    return httpx.create_ssl_context()  # SSL_CERT_FILE / SSL_CERT_DIR honoured, as httpx's default


def _transport(max_connections: int | None) -> httpx.AsyncHTTPTransport:
    """An httpcore pool of at most `max_connections` (None: no cap), idle ones expired at KEEPALIVE_S."""
    return httpx.AsyncHTTPTransport(retries=0, limits=pool_limits(max_connections), verify=_ssl_context())


def _origin(url: str) -> str:
    """The scheme, host and port of an endpoint's URL: its connection pool's key."""
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.netloc.decode('ascii')}"


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _error_message(content: bytes, reason: str) -> str:
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")[:200] or reason
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if "message" in body:
            return str(body["message"])[:500]
    return str(body)[:200]

"""Client of an env server (``orch env-server``), used by rollout workers.

Every call has a bounded timeout and fails with :class:`EnvServerError` (or its subclass
:class:`EnvServerTimeout`) carrying the method, URL and what went wrong. Nothing is retried:
the transport makes no retries (``retries=0``) and no call is re-issued. Cancelling a call (e.g.
through ``RolloutStream.cancel``/``aclose``) propagates ``CancelledError``; httpx closes the
connection of a request whose response was not fully read, and the server's disconnect
middleware then cancels its handler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from orchestrator.contracts import ComponentFailed, Task
from orchestrator.http_limits import pool_limits

__all__ = ["EnvServerError", "EnvServerPool", "EnvServerTimeout", "HttpEnvClient"]

T = TypeVar("T")
BACKOFF_S = (1.0, 30.0)  # a failed pool member's first and longest time set aside


class EnvServerError(ComponentFailed):
    """An env server call failed (unreachable, HTTP error status, malformed answer)."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class EnvServerTimeout(EnvServerError):
    """An env server call got no (complete) answer within its timeout."""


class HttpEnvClient:
    """``task(index)`` / ``score(task, completion)`` against an env server at ``base_url``.

    ``timeout`` bounds each call (connect, write, read and pool wait each; connect has its own
    ``connect_timeout``). One client multiplexes up to ``max_connections`` concurrent requests
    (None: no cap, a connection per request in flight); a request beyond it waits for a free
    connection, within its ``timeout``.
    Close it with :meth:`aclose` (or ``async with``). ``trust_env=False`` by default: proxies from
    the environment are ignored (env servers are normally reached directly).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        max_connections: int | None = None,
        trust_env: bool = False,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive (calls are always bounded)")
        if max_connections is not None and max_connections < 1:
            raise ValueError("max_connections >= 1 (or None: no cap)")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        limits = pool_limits(max_connections)  # nothing is retried: no call may meet a closing connection
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=httpx.AsyncHTTPTransport(retries=0, limits=limits),
            trust_env=trust_env,
        )

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        where = f"{method} {self.base_url}{path}"
        try:
            response = await self._client.request(method, path, json=body)
        except httpx.TimeoutException as exc:
            raise EnvServerTimeout(f"{where}: no answer within {self.timeout}s ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # httpx may surface a cancellation as a transport error: keep it a cancellation.
                raise asyncio.CancelledError() from exc
            raise EnvServerError(f"{where}: env server unreachable or connection failed: {exc!r}") from exc
        if response.status_code != 200:
            detail = response.text[:500]
            raise EnvServerError(f"{where}: HTTP {response.status_code}: {detail}", status_code=response.status_code)
        try:
            return response.json()
        except ValueError as exc:
            raise EnvServerError(f"{where}: answer is not JSON: {response.text[:200]!r}") from exc

    async def task(self, index: int) -> Task:
        data = await self._call("POST", "/task", {"index": index})
        try:
            return Task(
                env=data["env"],
                index=data["index"],
                prompt=data["prompt"],
                answer=data["answer"],
                messages=data.get("messages"),
            )
        except (KeyError, TypeError) as exc:
            raise EnvServerError(f"POST {self.base_url}/task: malformed task {data!r}") from exc

    async def score(self, task: Task, completion: str, *, delay_s: float | None = None) -> float:
        """Reward of ``completion`` for ``task``. ``delay_s`` asks the server for a simulated
        grader delay (tests, slow-grader simulations); None uses the server's default."""
        body: dict[str, Any] = {"index": task.index, "completion": completion, "env": task.env}
        if delay_s is not None:
            body["delay_s"] = delay_s
        data = await self._call("POST", "/score", body)
        reward = data.get("reward") if isinstance(data, dict) else None
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise EnvServerError(f"POST {self.base_url}/score: malformed answer {data!r}")
        return float(reward)

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health")

    async def stats(self) -> dict[str, int]:
        return await self._call("GET", "/stats")

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> HttpEnvClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def worth_another(err: EnvServerError) -> bool:
    """Whether another server of a pool may answer what this one failed: it timed out, could not
    be reached or failed itself (5xx); not a request it refused (4xx)."""
    return err.status_code is None or err.status_code >= 500


class _Member:
    def __init__(self, client: HttpEnvClient) -> None:
        self.client = client
        self.in_flight = 0
        self.failures = 0  # in a row
        self.retry_at = 0.0  # monotonic: set aside until then, then probed
        self.last_error = ""


class EnvServerPool:
    """``task`` / ``score`` against several env servers serving the same tasks (docs/scaling-out.md).

    Each call goes to the least busy server in service. A server that fails a call in a way another
    may not (:func:`worth_another`) is set aside with a growing backoff (1 s, doubling, at most
    30 s) and the call is sent to another: a task and a score are pure functions of their
    arguments, so sending one again is safe. A server set aside gets calls again once a probe
    (``GET /health``) after its backoff answers. With every server set aside a call waits for the
    first backoff to expire, for at most ``timeout`` in all, then fails naming each server's last
    error."""

    def __init__(self, base_urls: list[str], *, timeout: float = 30.0, **client_options: Any) -> None:
        if len(base_urls) < 2:
            raise ValueError("a pool has two env servers or more (one: HttpEnvClient)")
        self.timeout = timeout
        self.members = [_Member(HttpEnvClient(url, timeout=timeout, **client_options)) for url in base_urls]
        self.base_url = ", ".join(m.client.base_url for m in self.members)

    @property
    def clients(self) -> list[HttpEnvClient]:
        return [m.client for m in self.members]

    async def _in_service(self) -> _Member | None:
        """The least busy server in service, a server set aside probed first where its backoff
        is over; None: every one is set aside."""
        now = time.monotonic()
        for member in sorted(self.members, key=lambda m: m.in_flight):
            if member.failures == 0:
                return member
            if member.retry_at <= now:
                try:
                    await member.client.health()
                except EnvServerError as err:
                    self._set_aside(member, err)
                    continue
                member.failures = 0
                return member
        return None

    def _set_aside(self, member: _Member, err: EnvServerError) -> None:
        member.last_error = str(err)
        now = time.monotonic()
        if member.failures and member.retry_at > now:
            return  # set aside already: the other calls it had in flight fail with it, one failure
        member.failures += 1
        member.retry_at = now + min(BACKOFF_S[0] * 2 ** (member.failures - 1), BACKOFF_S[1])

    async def _call(self, call: Callable[[HttpEnvClient], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.timeout
        while True:
            member = await self._in_service()
            if member is None:
                wait = min(m.retry_at for m in self.members) - time.monotonic()
                if time.monotonic() + max(wait, 0.0) > deadline:
                    errors = "; ".join(f"{m.client.base_url}: {m.last_error}" for m in self.members)
                    raise EnvServerError(f"every env server of the pool failed within {self.timeout:g}s: {errors}")
                await asyncio.sleep(max(wait, 0.0))
                continue
            member.in_flight += 1
            try:
                return await call(member.client)
            except EnvServerError as err:
                if not worth_another(err):
                    raise
                self._set_aside(member, err)
            finally:
                member.in_flight -= 1

    async def task(self, index: int) -> Task:
        return await self._call(lambda client: client.task(index))

    async def score(self, task: Task, completion: str, *, delay_s: float | None = None) -> float:
        return await self._call(lambda client: client.score(task, completion, delay_s=delay_s))

    async def aclose(self) -> None:
        for member in self.members:
            await member.client.aclose()

    async def __aenter__(self) -> EnvServerPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

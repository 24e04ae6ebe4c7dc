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
from typing import Any

import httpx

from orchestrator.contracts import ComponentFailed, Task
from orchestrator.http_limits import pool_limits

__all__ = ["EnvServerError", "EnvServerTimeout", "HttpEnvClient"]


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

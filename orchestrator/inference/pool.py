"""An endpoint's HTTP connections as several small httpcore pools (shards), so that a request's
pool bookkeeping does not grow with the endpoint's connections.

httpcore scans every connection of its pool, and every request queued on it, at each request's
start and end (for each idle connection it counts the idle ones again: quadratic in the pool's
connections), so with hundreds of streams in flight on one pool that scan is most of a request's
cost. Here each shard takes at most `SHARD_CONNECTIONS` requests at once, few enough that the
scan is cheap; shards are cheap to make (they share one TLS context). A request goes to the
shard with the fewest requests in flight that has room (a new shard when none has), so each scan
is over one shard. Caps on
connections are the client's (`InferenceClient`'s slots), not the shards': a shard's pool has no
cap of its own, so it never makes a request wait.

A request cancelled inside httpcore's pool (a reload ending a stream before its first token, a
drain) can leave behind a connection that was assigned to it and never opened: httpcore 1.0
neither reuses nor reaps it, so it holds a pool slot for good (encode/httpcore#1093). In a capped
pool enough of them make every later request wait until its pool timeout, against a healthy
server. So a shard in which a request was cancelled takes no new request, and is closed (every
connection of its pool, those included) once its last request has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

SHARD_CONNECTIONS = 4


@dataclass(eq=False)
class _Shard:
    transport: httpx.AsyncHTTPTransport
    inflight: int = 0


class ShardedTransport(httpx.AsyncBaseTransport):
    """One endpoint's requests in shards of at most `SHARD_CONNECTIONS` each (see the module)."""

    def __init__(self, shard: Callable[[], httpx.AsyncHTTPTransport]):
        self._make = shard  # a shard's transport: a pool without a connection cap
        self._shards: list[_Shard] = []
        self._retired: list[_Shard] = []  # a request was cancelled in each: closed once drained

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._retired:
            await self._close_drained()
        shard = min(self._shards, key=lambda s: s.inflight, default=None)
        if shard is None or shard.inflight >= SHARD_CONNECTIONS:
            shard = _Shard(self._make())
            self._shards.append(shard)
        shard.inflight += 1
        try:
            response = await shard.transport.handle_async_request(request)
        except asyncio.CancelledError:
            shard.inflight -= 1
            self._retire(shard)
            raise
        except BaseException:
            shard.inflight -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, shard)
        return response

    def _retire(self, shard: _Shard) -> None:
        """No new request goes to `shard`; it is closed once drained (see the module)."""
        if shard in self._shards:
            self._shards.remove(shard)
            self._retired.append(shard)

    async def _close_drained(self) -> None:
        drained = [shard for shard in self._retired if shard.inflight == 0]
        for shard in drained:
            self._retired.remove(shard)
        for shard in drained:
            await shard.transport.aclose()

    async def aclose(self) -> None:
        shards, self._shards, self._retired = self._shards + self._retired, [], []
        for shard in shards:
            await shard.transport.aclose()


class _CountedStream(httpx.AsyncByteStream):
    """A response's body, its shard's request counted in flight until it is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, shard: _Shard):
        self._stream = stream
        self._shard: _Shard | None = shard

    def __aiter__(self) -> AsyncIterator[bytes]:  # the body's own iterator: no layer per read
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._shard is not None:
                self._shard.inflight -= 1
                self._shard = None


class ByOrigin(httpx.AsyncBaseTransport):
    """Each request to the transport of its origin (scheme://host[:port]) by one dict look-up,
    `other` for the rest: httpx's own `mounts` try every pattern per request, a cost that grows
    with the endpoints."""

    def __init__(self, transports: dict[str, httpx.AsyncBaseTransport], other: httpx.AsyncBaseTransport):
        self._transports, self._other = transports, other

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        transport = self._transports.get(f"{url.scheme}://{url.netloc.decode('ascii')}", self._other)
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in (*self._transports.values(), self._other):
            await transport.aclose()

"""An endpoint's HTTP connections as several small httpcore pools (shards), so that a request's
pool bookkeeping does not grow with the endpoint's connections.

httpcore scans every connection of its pool, and every request queued on it, at each request's
start and end: with hundreds of streams in flight on one pool that scan is most of a short
request's cost, and the whole is quadratic in the streams. Here each shard holds at most
`SHARD_CONNECTIONS`; a request goes to the shard with the fewest requests in flight that has
room (a new shard when none has), so each scan is over one shard. Caps on connections are the
client's (`InferenceClient`'s slots), not the shards': a shard never makes a request wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

SHARD_CONNECTIONS = 32


@dataclass(eq=False)
class _Shard:
    transport: httpx.AsyncHTTPTransport
    inflight: int = 0


class ShardedTransport(httpx.AsyncBaseTransport):
    """One endpoint's connections in shards of at most `SHARD_CONNECTIONS` (see the module)."""

    def __init__(self, shard: Callable[[int], httpx.AsyncHTTPTransport]):
        self._make = shard  # a shard that holds at most this many connections
        self._shards: list[_Shard] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        shard = min(self._shards, key=lambda s: s.inflight, default=None)
        if shard is None or shard.inflight >= SHARD_CONNECTIONS:
            shard = _Shard(self._make(SHARD_CONNECTIONS))
            self._shards.append(shard)
        shard.inflight += 1
        try:
            response = await shard.transport.handle_async_request(request)
        except BaseException:
            shard.inflight -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, shard)
        return response

    async def aclose(self) -> None:
        for shard in self._shards:
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

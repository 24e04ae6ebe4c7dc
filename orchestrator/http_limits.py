"""Connection limits the HTTP clients share (a leaf: httpx alone).

Idle connections are dropped well before the servers' keep-alive timeout (uvicorn's and vLLM's:
5 s), so none is reused as the server closes it: a request sent on it would fail although the
server is up."""

from __future__ import annotations

import httpx

KEEPALIVE_S = 2.0


def pool_limits(max_connections: int | None) -> httpx.Limits:
    """At most `max_connections` open (None: no cap), idle ones expired at KEEPALIVE_S."""
    return httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=KEEPALIVE_S
    )

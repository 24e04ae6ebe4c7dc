"""URL rules the config sections and the inference client share, and where a local service
listens (a leaf: the stdlib alone)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def free_port(host: str) -> int:
    """A port of ``host`` free now (the OS's pick), for a server about to listen on it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def endpoint_base_urls(urls: list[str]) -> list[str]:
    """The endpoints as the client addresses them (`endpoint_base_url`); ValueError naming the
    URL if one is not an http(s) URL or two are the same endpoint. The config checks it (exit 2
    before anything runs) and the client, also usable on its own, builds on it."""
    seen: dict[str, str] = {}
    for url in urls:
        base = endpoint_base_url(url)
        check_http_url(base, f"endpoint {url!r}")
        if base in seen:
            raise ValueError(f"endpoints {seen[base]!r} and {url!r} are the same")
        seen[base] = url
    return list(seen)


def check_http_url(url: str, what: str) -> None:
    """ValueError naming `what` unless `url` is http(s)://host[:port][/path] with a valid port
    (no spaces, user, query or fragment)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0-65535
    except ValueError:
        raise ValueError(f"{what} has an invalid host or port") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or any(c.isspace() for c in url)
        or "@" in parts.netloc
        or parts.query
        or parts.fragment
        or parts.netloc.endswith(":")
    ):
        raise ValueError(f"{what} is not an http(s)://host[:port] URL")


def endpoint_base_url(url: str) -> str:
    """An endpoint as the client addresses it: scheme added (http), trailing `/` and `/v1` removed."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url.removesuffix("/v1")

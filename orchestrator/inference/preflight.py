"""The pre-flight check of given inference endpoints: before the run dir exists, each endpoint is
probed (`/health`, `/v1/models`, and its routes), all at once, for at most
``inference.openai.preflight_timeout_s``, before the model is built. An endpoint that refuses the
connection (at once: nothing listens there), does not answer in that bound, answers with an error
that will not pass (a 4xx other than 408/429, or the same HTTP 500 twice), is an engine whose
weights the chosen ``weight_sync`` cannot load, or cannot load the weights the trainer publishes
is one line naming it and what to use (docs/vllm.md "Before the run"), rather than a run dir that
fails minutes later and cannot be resumed with another weight sync.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from orchestrator.inference.errors import same_server_error_again
from orchestrator.inference.weight_sync import DIALECTS

# The routes that tell an engine from its /openapi.json (vLLM and SGLang are FastAPI apps).
VLLM_ROUTES = frozenset({"/pause", "/is_paused", "/collective_rpc", "/v1/load_lora_adapter", "/ping", "/tokenize"})
SGLANG_ROUTES = frozenset({"/update_weights_from_disk", "/get_model_info", "/flush_cache"})
# How a message names an engine (the one a dialect loads: its `engine`).
ENGINE_NAMES = {"vllm": "a vLLM server", "sglang": "an SGLang server", "orch": "an `orch serve` server"}
# The weight format each engine loads (a trainer's `weight_format`), and how a message names it.
ENGINE_LOADS = {"vllm": "hf", "sglang": "hf", "orch": "orch"}
FORMAT_NAMES = {"hf": "HF model dirs", "orch": "`orch serve`'s own policy files"}
# Refusals a retry may get past (request timeout, rate limit).
TRANSIENT_4XX = frozenset({408, 429})
_POLL_S = 0.25


class PreflightError(Exception):
    """An endpoint that cannot serve the run; one line naming it."""


@dataclass
class _Answer:
    status: int | None  # None: no HTTP answer (connection refused, timed out)
    body: str
    json: object = None
    refused: bool = False  # the connection was refused: nothing listens there


async def check_endpoints(
    urls: list[str], weight_sync: str, timeout_s: float, weight_format: str | None = None
) -> dict[str, str | None]:
    """Probe every endpoint (base URLs) at once, each for at most `timeout_s`; the engine each one
    is ("vllm", "sglang", "orch", None: not recognised). `weight_format`: what the trainer
    publishes (a `TrainerComponent.weight_format`; None: no weights). PreflightError (one line)
    otherwise."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(max(timeout_s, 0.1)), trust_env=False) as http:
        engines = await asyncio.gather(*(_check_one(http, url, weight_sync, timeout_s, weight_format) for url in urls))
    return dict(zip(urls, engines, strict=True))


async def _check_one(
    http: httpx.AsyncClient, url: str, weight_sync: str, timeout_s: float, weight_format: str | None
) -> str | None:
    deadline = time.monotonic() + timeout_s
    models = await _until_answered(http, url, "/v1/models", deadline, timeout_s)
    if models.status != 200 or not isinstance(models.json, dict):
        what = f"answered HTTP {models.status}: {models.body}" if models.status else f"got {models.body}"
        raise PreflightError(f"inference endpoint {url} cannot serve the run: GET /v1/models {what}")
    health = await _get(http, url, "/health", deadline)
    if health.status is not None and health.status >= 500:  # 404: a server without the route
        raise PreflightError(f"inference endpoint {url} is not healthy: GET /health answered HTTP {health.status}")
    engine = await _engine(http, url, deadline)
    dialect = DIALECTS[weight_sync]
    if engine is not None and dialect.loads and weight_format not in (None, ENGINE_LOADS[engine]):
        published = FORMAT_NAMES.get(weight_format, repr(weight_format))  # a plugin trainer's own: as named
        raise PreflightError(
            f"inference endpoint {url} is {ENGINE_NAMES[engine]} (from its routes), which loads "
            f"{FORMAT_NAMES[ENGINE_LOADS[engine]]}, not the {published} the trainer publishes: "
            "sample with vLLM or SGLang endpoints, or let the run launch vLLM (docs/vllm.md)"
        )
    if engine is not None and dialect.loads and dialect.engine != engine:
        fits = " or ".join(f"inference.openai.weight_sync={name}" for name, d in DIALECTS.items() if d.engine == engine)
        raise PreflightError(
            f"inference endpoint {url} is {ENGINE_NAMES[engine]} (from its routes), whose weights weight_sync "
            f"{weight_sync!r} cannot load: use --set {fits}"
        )
    return engine


async def _until_answered(http: httpx.AsyncClient, url: str, path: str, deadline: float, timeout_s: float) -> _Answer:
    """GET `path` until an answer that will not change: a 2xx, a 4xx other than 408/429, or the
    same HTTP 500 twice in a row (`same_server_error_again`), or a refused connection (nothing
    listens there: waiting would not change it); no answer (timed out) or a transient one is asked
    again until `deadline`."""
    last: _Answer | None = None
    while True:
        answer = await _get(http, url, path, deadline)
        status = answer.status
        if answer.refused or (status is not None and status < 500 and status not in TRANSIENT_4XX):
            return answer
        if status is not None and last is not None and last.status is not None:
            if same_server_error_again((last.status, path, last.body), (status, path, answer.body)):
                return answer
        last = answer
        if time.monotonic() + _POLL_S >= deadline:
            if status is None:
                answer.body = f"no answer within {timeout_s:g}s ({answer.body})"
            return answer
        await asyncio.sleep(_POLL_S)


async def _get(http: httpx.AsyncClient, url: str, path: str, deadline: float) -> _Answer:
    left = deadline - time.monotonic()
    if left <= 0:
        return _Answer(None, "out of time")
    try:
        resp = await http.get(url + path, timeout=left)
    except httpx.ConnectError as exc:
        if _refused(exc):
            return _Answer(None, "connection refused: nothing listens there", refused=True)
        return _Answer(None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    except httpx.HTTPError as exc:
        return _Answer(None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    body = " ".join(resp.text.split())[:200]
    try:
        parsed = resp.json()
    except ValueError:
        parsed = None
    return _Answer(resp.status_code, body, parsed)


def _refused(exc: BaseException) -> bool:
    """Was the connection refused? httpx wraps the OS error a few levels down."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _engine(http: httpx.AsyncClient, url: str, deadline: float) -> str | None:
    """The engine an endpoint is, from its routes: vLLM and SGLang list them in /openapi.json;
    `orch serve` answers /version with the integer version it serves."""
    spec = await _get(http, url, "/openapi.json", deadline)
    paths = spec.json.get("paths") if isinstance(spec.json, dict) else None
    if isinstance(paths, dict):
        routes = set(paths)
        if routes & SGLANG_ROUTES:
            return "sglang"
        if routes & VLLM_ROUTES:
            return "vllm"
    version = await _get(http, url, "/version", deadline)
    if isinstance(version.json, dict) and type(version.json.get("version")) is int:
        return "orch"
    return None

"""verifiers' model calls, routed through orch's inference client (pinned: verifiers 0.4.0, renderers 0.1.12).

verifiers' `TrainClient` renders the chat template client-side and posts the prompt's token ids to
vLLM's ``POST /inference/v1/generate`` through an ``openai.AsyncOpenAI`` client. Here that client's
HTTP transport is :class:`RoutedTransport`: each call goes through the run's
:class:`~orchestrator.inference.client.InferenceClient` (:meth:`~.InferenceClient.generate`)
instead of to one URL, so it gets the run's routing (least loaded endpoint, the group pinned to
one), bounded retries on another endpoint, the weight version the endpoint holds, and
cancellation (a cancelled rollout drops its request).

Two things verifiers cannot be told through its config, so they are adapted here and only here:

* renderers 0.1.12 reads each sampled token's logprob entry as ``{"token": "token_id:N"}``; vLLM 0.32
  answers ``{"token_id": N}`` (:func:`renderers_logprobs`).
* the interception server builds its model client with ``resolve_client(config)``; for an
  :class:`OrchClientConfig` that is an :class:`OrchTrainClient` on this transport
  (:func:`install`, idempotent).

Each call's session id header (verifiers sends the rollout's trace id) names the rollout; the
rollout registers its trace with :meth:`GenerateRoute.open` when verifiers mints it, and reads what
its calls saw (:class:`CallRecord`: the endpoint, the versions, vLLM's answer) at its end.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson

from orchestrator.contracts import ModelCalls
from orchestrator.inference.client import InferenceRequestError, InferenceUnavailable
from orchestrator.inference.protocol import GENERATE_PATH

MODELS_PATH = "/v1/models"
SESSION_HEADER = "x-session-id"  # verifiers.v1.clients.client.SESSION_ID_HEADER, lower-cased
_routes: dict[str, GenerateRoute] = {}
_route_ids = itertools.count()


def renderers_logprobs(answer: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.32's generate answer with each ``choices[i].logprobs.content[j]`` also carrying the
    ``"token": "token_id:N"`` renderers 0.1.12 checks (its ``token_id`` and ``logprob`` untouched)."""
    for choice in answer.get("choices") or []:
        content = (choice.get("logprobs") or {}).get("content") if isinstance(choice, dict) else None
        for entry in content or []:
            if isinstance(entry, dict) and "token" not in entry and isinstance(entry.get("token_id"), int):
                entry["token"] = f"token_id:{entry['token_id']}"
    return answer


def prompt_key(token_ids: list[int]) -> tuple[int, bytes]:
    """What tells one prompt from another: its length and a digest of its int32 token ids."""
    return len(token_ids), hashlib.blake2b(array("i", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class CallRecord:
    """One model call of a rollout, as the endpoint saw and answered it."""

    endpoint: str
    # The token ids it was sent (the generate body's `token_ids`), kept as their length and digest
    # (`prompt_key`): an agent's long context is held once, in verifiers' trace, not per call.
    prompt: tuple[int, bytes]
    answer: dict[str, Any]
    policy_start: int
    policy_end: int
    attempts: int
    http_s: float  # the answering attempt's HTTP exchange
    route_s: float = 0.0  # the whole call through the route (retries, JSON, the logprob shape)


@dataclass
class Rollout:
    pin: Any  # the key that keeps a group on one endpoint
    at_version: int | None = None  # an eval's pinned version (`InferenceClient.generate`)
    calls: list[CallRecord] = field(default_factory=list)


class GenerateRoute:
    """Routes the generate calls of every rollout of a run through `client`."""

    def __init__(self, client: ModelCalls):
        self.client = client
        self.id = f"orch-{next(_route_ids)}"
        self._sessions: dict[str, Rollout] = {}

    def open(self, session_id: str, pin: Any, at_version: int | None = None) -> Rollout:
        """Register a rollout's trace id (verifiers' session id) before its first model call."""
        rollout = self._sessions[session_id] = Rollout(pin, at_version)
        return rollout

    def close(self, session_id: str) -> Rollout | None:
        """Forget a rollout's trace id; returns what its calls saw."""
        return self._sessions.pop(session_id, None)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.endswith(MODELS_PATH):
            # renderers asks for max_model_len once per (base URL, model); any endpoint answers.
            try:
                return _json(200, await self.client.models())
            except InferenceUnavailable as err:
                return _json(503, {"error": {"message": str(err)}})
        if request.method != "POST" or not path.endswith(GENERATE_PATH):
            return _json(404, {"error": {"message": f"orch routes only {GENERATE_PATH}, not {request.method} {path}"}})
        session = request.headers.get(SESSION_HEADER)
        rollout = self._sessions.get(session) if session else None
        if rollout is None:
            return _json(400, {"error": {"message": f"generate call of an unknown rollout (session {session!r})"}})
        began = time.perf_counter()
        body = orjson.loads(request.content)
        try:
            done = await self.client.generate(GENERATE_PATH, body, pin=rollout.pin, at_version=rollout.at_version)
        except InferenceRequestError as err:
            return _json(err.status_code or 400, {"error": {"message": str(err)}})
        except InferenceUnavailable as err:  # retries spent: verifiers fails the turn, orch the episode
            return _json(503, {"error": {"message": str(err)}})
        record = CallRecord(
            done.endpoint,
            prompt_key(body.get("token_ids") or []),
            done.answer,
            done.policy_start,
            done.policy_end,
            done.attempts,
            done.http_s,
        )
        rollout.calls.append(record)
        answered = _json(200, renderers_logprobs(orjson.loads(orjson.dumps(done.answer))))
        record.route_s = time.perf_counter() - began
        return answered


class RoutedTransport(httpx.AsyncBaseTransport):
    """An httpx transport that hands every request to a :class:`GenerateRoute`."""

    def __init__(self, route: GenerateRoute):
        self.route = route

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return await self.route.handle(request)


def _json(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, content=orjson.dumps(body), headers={"content-type": "application/json"})


# --- verifiers' side ---------------------------------------------------------------------------


def _client_types():
    import verifiers.v1 as vf
    from verifiers.v1.clients.train import ElasticRendererPool, TrainClient

    class OrchClientConfig(vf.TrainClientConfig):
        """A TrainClientConfig whose calls go through the orch route named `route`."""

        type: Literal["train"] = "train"
        route: str

    class OrchTrainClient(TrainClient):
        """verifiers' TrainClient, its OpenAI client on a :class:`RoutedTransport`."""

        def __init__(self, config: OrchClientConfig) -> None:  # replaces TrainClient's: no direct URL
            from openai import AsyncOpenAI

            self.config = config
            self.client = AsyncOpenAI(
                base_url=config.base_url,
                api_key="orch",
                max_retries=0,
                http_client=httpx.AsyncClient(transport=RoutedTransport(_routes[config.route])),
            )
            if config.renderer_model_name is not None:
                ElasticRendererPool(config.renderer_model_name, config.renderer, multiplex=config.multiplex).warm()

    return OrchClientConfig, OrchTrainClient


_installed: dict[str, Any] = {}


def install() -> type:
    """Make verifiers' interception server build an OrchTrainClient for an OrchClientConfig
    (other configs as before); returns the OrchClientConfig class."""
    if not _installed:
        from verifiers.v1.interception import server

        config_type, client_type = _client_types()
        original: Callable = server.resolve_client

        def resolve_client(config):
            return client_type(config) if isinstance(config, config_type) else original(config)

        server.resolve_client = resolve_client
        _installed["config"] = config_type
    return _installed["config"]


def client_config(route: GenerateRoute, renderer_model: str, renderer: dict[str, Any] | None = None):
    """The verifiers client config whose calls take `route` (registered until :func:`forget`)."""
    config_type = install()
    _routes[route.id] = route
    # base_url is never dialled (the transport routes); renderers derives the generate URL from it.
    return config_type(
        base_url="http://orch.invalid/v1",
        api_key_var="ORCH_UNUSED_API_KEY",
        route=route.id,
        renderer_model_name=renderer_model,
        renderer=renderer,
    )


def forget(route: GenerateRoute) -> None:
    _routes.pop(route.id, None)

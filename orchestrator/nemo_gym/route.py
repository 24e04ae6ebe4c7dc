"""orch's model route for NeMo Gym agents: an OpenAI Responses endpoint (``POST /v1/responses``)
inside orch, which the agent's config names as its model server.

Each call is rendered with the run's tokenizer (the chat template, the assistant's turn opened)
and sampled through the run's inference client (``/inference/v1/generate``, token ids in and out,
as verifiers' calls are): the run's routing, retries, eval pin and weight versions. The answer
is a Responses object whose one output message carries the text and, as NeMo Gym's own vLLM model
server gives them, ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs``.

A call names its episode in ``metadata["orch_episode"]`` (orch puts it in every row's
``responses_create_params``, which NeMo Gym's agents pass through to each model call); the
route keeps what each episode's calls sent and got (:class:`Call`) until the episode reads them.
The route does not parse tool calls out of the text: the output is one assistant message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from orchestrator.contracts import ModelCalls
from orchestrator.inference.client import InferenceRequestError, InferenceUnavailable

GENERATE_PATH = "/inference/v1/generate"
EPISODE_KEY = "orch_episode"  # the metadata key that names a call's episode
START_TIMEOUT_S = 10.0  # an in-process server's start-up (uvicorn on a bound socket)
STOP_TIMEOUT_S = 5.0  # ... and its stop; its requests in flight are cancelled after it


class RouteError(ValueError):
    """A Responses request orch cannot sample (answered 400, with this message)."""


@dataclass
class Call:
    """One model call of an episode: the tokens sent and sampled, and the versions that sampled them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_start: int
    policy_end: int
    finish_reason: str | None


@dataclass
class Episode:
    pin: Any  # the group's key: its calls stay on one endpoint
    at_version: int | None  # an eval's pinned version
    temperature: float
    max_tokens: int
    calls: list[Call] = field(default_factory=list)


def text_of(content: Any) -> str:
    """A Responses message content (a string, or a list of text parts) as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise RouteError(f"a message content of type {type(content).__name__}")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's `instructions` and `input` as chat messages (a function call as the
    assistant's tool call, its output as a tool message; reasoning items are left out)."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RouteError("the request has no input")
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": text_of(item.get("content", ""))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
        elif kind != "reasoning":
            raise RouteError(f"an input item of type {kind!r}")
    return messages


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A Responses request's function tools as the chat template takes them."""
    tools = [
        {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}
        for tool in body.get("tools") or []
        if tool.get("type") == "function"
    ]
    return tools or None


class ResponsesRoute:
    """The route of a run's NeMo Gym model calls through `client` (module docstring)."""

    def __init__(self, tokenizer: Any, model: str, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.model = tokenizer, model
        self.template_kwargs = dict(template_kwargs or {})
        self.client: ModelCalls | None = None  # the run's, bound by its first episode
        self._episodes: dict[str, Episode] = {}
        self._ids = itertools.count()

    def open(self, key: str, episode: Episode, client: ModelCalls) -> None:
        """Record the model calls naming `key` until :meth:`close`, sampled through `client`
        (the backend's; one per run)."""
        if self.client is None:
            self.client = client
        elif self.client is not client:
            raise RuntimeError("a nemo_gym env samples through one inference client per run")
        self._episodes[key] = episode

    def close(self, key: str) -> Episode | None:
        return self._episodes.pop(key, None)

    def render(self, body: dict[str, Any]) -> list[int]:
        from orchestrator.hf.model import render_prompt

        try:
            return render_prompt(
                self.tokenizer, "", chat_messages(body), tools=chat_tools(body), **self.template_kwargs
            )
        except RouteError:
            raise
        except Exception as err:  # noqa: BLE001 - the template's own error, answered to the agent
            raise RouteError(f"the chat template cannot render the request: {type(err).__name__}: {err}") from None

    async def respond(self, body: dict[str, Any]) -> dict[str, Any]:
        """The Responses answer to `body`: sampled for its episode, and recorded (RouteError for
        a request of no open episode or one the template cannot render)."""
        key = (body.get("metadata") or {}).get(EPISODE_KEY)
        episode = self._episodes.get(key) if key is not None else None
        if episode is None:
            raise RouteError(f"a model call of no episode in flight (metadata.{EPISODE_KEY} = {key!r})")
        prompt_ids = self.render(body)
        asked = body.get("max_output_tokens")
        max_tokens = min(episode.max_tokens, asked) if isinstance(asked, int) and asked > 0 else episode.max_tokens
        sampling = {"temperature": episode.temperature, "max_tokens": max_tokens, "logprobs": 0}
        assert self.client is not None  # bound by the episode's open
        done = await self.client.generate(
            GENERATE_PATH,
            {"token_ids": prompt_ids, "sampling_params": sampling},
            pin=episode.pin,
            at_version=episode.at_version,
        )
        choice = (done.answer.get("choices") or [{}])[0]
        completion = list(choice.get("token_ids") or [])
        logprobs = [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []]
        if len(logprobs) != len(completion):
            raise InferenceRequestError(
                f"{done.endpoint} answered {len(completion)} tokens with {len(logprobs)} logprobs", 502
            )
        finish = choice.get("finish_reason")
        episode.calls.append(Call(prompt_ids, completion, logprobs, done.policy_start, done.policy_end, finish))
        return self.answer(body, prompt_ids, completion, logprobs, finish)

    def answer(self, body, prompt_ids, completion, logprobs, finish) -> dict[str, Any]:
        n = next(self._ids)
        message = {
            "id": f"msg_orch_{n}",
            "type": "message",
            "role": "assistant",
            "status": "incomplete" if finish == "length" else "completed",
            "content": [
                {
                    "type": "output_text",
                    "text": self.tokenizer.decode(completion, skip_special_tokens=True),
                    "annotations": [],
                }
            ],
            "prompt_token_ids": prompt_ids,
            "generation_token_ids": completion,
            "generation_log_probs": logprobs,
        }
        return {
            "id": f"resp_orch_{n}",
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model,
            "output": [message],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata"),
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "usage": {
                "input_tokens": len(prompt_ids),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(completion),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(prompt_ids) + len(completion),
            },
        }

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            try:
                body = orjson.loads(await request.body())
                if not isinstance(body, dict):
                    raise RouteError("the request body is not a JSON object")
                return _json(200, await self.respond(body))
            except (RouteError, orjson.JSONDecodeError) as err:
                return _json(400, {"error": {"message": str(err)}})
            except InferenceRequestError as err:
                return _json(err.status_code or 400, {"error": {"message": str(err)}})
            except InferenceUnavailable as err:  # retries spent: the agent fails its run, orch the episode
                return _json(503, {"error": {"message": str(err)}})

        async def alive(_: Request) -> Response:
            return _json(200, {"status": "ok"})

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]), Route("/", alive)])

    def serving(self, host: str, port: int) -> contextlib.AbstractAsyncContextManager[int]:
        """The route served on (host, port) for the block (port 0: a free one); yields the port."""
        return serve_app(self.app(), host, port, "orch's NeMo Gym route")


@contextlib.asynccontextmanager
async def serve_app(app: Any, host: str, port: int, what: str) -> AsyncIterator[int]:
    """An ASGI `app` served by uvicorn in this event loop for the block (port 0: a free one);
    yields the port. Its task is this block's: stopped (then cancelled, past a bound) at its end."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    server.install_signal_handlers = lambda: None  # the run owns SIGINT/SIGTERM
    loop = asyncio.get_running_loop()
    task = loop.create_task(server.serve(sockets=[sock]), name=what)
    try:
        deadline = loop.time() + START_TIMEOUT_S
        while not server.started:  # its socket is bound already: only the app's start-up is waited for
            if task.done():
                task.result()
                raise RuntimeError(f"{what} on {host}:{port} stopped before it served")
            if loop.time() > deadline:
                raise RuntimeError(f"{what} on {host}:{port} not serving after {START_TIMEOUT_S:g}s")
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), STOP_TIMEOUT_S)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sock.close()


def _json(status: int, body: Any) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")

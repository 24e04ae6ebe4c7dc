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
import concurrent.futures
import contextlib
import itertools
import secrets
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
from orchestrator.envs.server import serving
from orchestrator.inference.client import InferenceRequestError, InferenceUnavailable
from orchestrator.inference.protocol import GENERATE_PATH

EPISODE_KEY = "orch_episode"  # the metadata key that names a call's episode


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
    sampling: set[asyncio.Task] = field(default_factory=set)  # its model calls being sampled (cancelled at close)
    error: BaseException | None = None  # the first call the route could not answer, and why


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
        # Episode keys carry this route's own prefix: a call of another orch process's episode
        # (an agent that outlived it) names no episode here, even of the same id.
        self.prefix = secrets.token_hex(4)
        self._episodes: dict[str, Episode] = {}
        self._ids = itertools.count()
        # The chat template and the decode run off the event loop (an agent's context grows with
        # its turns), one at a time: a tokenizer is not made to be used by several threads at once.
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-route")

    def key(self, episode_id: int) -> str:
        """The name of an orch episode in its model calls' metadata."""
        return f"{self.prefix}-{episode_id}"

    def open(self, key: str, episode: Episode, client: ModelCalls) -> None:
        """Record the model calls naming `key` until :meth:`close`, sampled through `client`
        (the backend's; one per run)."""
        if self.client is None:
            self.client = client
        elif self.client is not client:
            raise RuntimeError("a nemo_gym env samples through one inference client per run")
        self._episodes[key] = episode

    def close(self, key: str) -> Episode | None:
        """Forget episode `key`: its calls still being sampled are cancelled (their agent is told
        the episode ended); returns what its calls saw."""
        episode = self._episodes.pop(key, None)
        if episode is not None:
            for task in episode.sampling:
                task.cancel()
        return episode

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
        metadata = body.get("metadata")
        key = metadata.get(EPISODE_KEY) if isinstance(metadata, dict) else None
        episode = self._episodes.get(key) if isinstance(key, str) else None
        if episode is None:
            raise RouteError(f"a model call of no episode in flight (metadata.{EPISODE_KEY} = {key!r})")
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(self._tokenizing, self.render, body)
        asked = body.get("max_output_tokens")
        max_tokens = min(episode.max_tokens, asked) if isinstance(asked, int) and asked > 0 else episode.max_tokens
        sampling = {"temperature": episode.temperature, "max_tokens": max_tokens, "logprobs": 0}
        assert self.client is not None  # bound by the episode's open
        call = loop.create_task(
            self.client.generate(
                GENERATE_PATH,
                {"token_ids": prompt_ids, "sampling_params": sampling},
                pin=episode.pin,
                at_version=episode.at_version,
            )
        )
        episode.sampling.add(call)  # owned by the episode: awaited here, cancelled by its close
        try:
            done = await call
        except asyncio.CancelledError:
            if call.cancelled() and not _cancelling():  # the episode closed, not this request
                raise RouteError(f"episode {key} ended while its model call was sampled") from None
            raise
        finally:
            episode.sampling.discard(call)
        choice = (done.answer.get("choices") or [{}])[0]
        completion = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [entry.get("logprob") for entry in content if isinstance(entry, dict)]
        if len(logprobs) != len(completion) or not all(isinstance(lp, float | int) for lp in logprobs):
            raise InferenceRequestError(
                f"{done.endpoint} answered {len(completion)} tokens with {len(content)} logprob entries", 502
            )
        finish = choice.get("finish_reason")
        episode.calls.append(Call(prompt_ids, completion, logprobs, done.policy_start, done.policy_end, finish))
        text = await loop.run_in_executor(self._tokenizing, self.decode, completion)
        return self.answer(body, prompt_ids, completion, logprobs, finish, text)

    def decode(self, completion: list[int]) -> str:
        return self.tokenizer.decode(completion, skip_special_tokens=True)

    def answer(self, body, prompt_ids, completion, logprobs, finish, text: str) -> dict[str, Any]:
        n = next(self._ids)
        message = {
            "id": f"msg_orch_{n}",
            "type": "message",
            "role": "assistant",
            "status": "incomplete" if finish == "length" else "completed",
            "content": [
                {
                    "type": "output_text",
                    "text": text,
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

    def _refused(self, body: Any, err: BaseException, status: int) -> Response:
        """The answer to a call the route could not serve; its episode (if any) keeps the first such error."""
        metadata = body.get("metadata") if isinstance(body, dict) else None
        key = metadata.get(EPISODE_KEY) if isinstance(metadata, dict) else None
        episode = self._episodes.get(key) if isinstance(key, str) else None
        if episode is not None and episode.error is None:
            episode.error = err
        return _json(status, {"error": {"message": str(err)}})

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body: Any = None
            try:
                body = orjson.loads(await request.body())
                if not isinstance(body, dict):
                    raise RouteError("the request body is not a JSON object")
                return _json(200, await self.respond(body))
            except (RouteError, orjson.JSONDecodeError) as err:
                return self._refused(body, err, 400)
            except InferenceRequestError as err:
                return self._refused(body, err, err.status_code or 400)
            except InferenceUnavailable as err:  # retries spent: the agent fails its run, orch the episode
                return self._refused(body, err, 503)
            except Exception as err:  # noqa: BLE001 - answered in one line, and the episode fails with it
                return self._refused(body, RouteError(f"orch's route failed: {type(err).__name__}: {err}"), 500)

        async def alive(_: Request) -> Response:
            return _json(200, {"status": "ok"})

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]), Route("/", alive)])

    @contextlib.asynccontextmanager
    async def serving(self, host: str, port: int) -> AsyncIterator[int]:
        """The route served on (host, port) for the block (port 0: a free one); yields the port."""
        try:
            async with serving(self.app(), "orch's NeMo Gym route", host=host, port=port) as bound:
                yield bound
        finally:
            self._tokenizing.shutdown(wait=True)  # at most the one render or decode under way


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _json(status: int, body: Any) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")

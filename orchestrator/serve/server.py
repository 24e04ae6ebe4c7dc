"""`orch serve`: its char-level torch policy behind an OpenAI-compatible completions API.

Endpoints (JSON; request/response formats in :mod:`orchestrator.inference.protocol`):

* ``POST /v1/completions``  sample (text or token-id prompts, n, temperature, max_tokens, logprobs,
  seed); 503 until weights are loaded.
* ``POST /update_weights {"path": weights_dir, "version": N}``  load a published (STABLE) weights
  directory and make it current; answers ``{"version": current, "requested": N, "ignored": bool}``
  once loaded (a version older than the current one is ignored). 409 if ``path`` is not published.
* ``GET /version`` -> ``{"version", "path"}``; ``GET /health`` -> ``{"status": "ok", "version",
  "model", "loaded"}``; ``GET /v1/models``; ``GET /stats`` (request counters).

Sampling runs off the event loop, in one worker thread: requests that arrive while a batch is being
sampled are grouped by (n, temperature, max_tokens) and sampled together in the next call (the
embedded sampler is several times cheaper per group when batched; each request keeps its own seeded
generator). A client that disconnects has its request withdrawn (or its result dropped).

Several servers on one machine: one process per port (``--port 0`` picks a free one; the first
stdout line says where it listens). Each process uses ``--threads`` torch threads (default 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from orchestrator.envs.server import disconnect_cancelling_app, serve_command_line
from orchestrator.inference.protocol import (
    CompletionParams,
    ProtocolError,
    choice_body,
    error_body,
    parse_completion_request,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "orch-policy"


class RequestError(ValueError):
    """A request the policy cannot serve (bad prompt, does not fit); answered with 400."""


@dataclass(eq=False)
class _Pending:
    prompts: list[str]
    seeds: list[int]
    n: int
    temperature: float
    max_tokens: int
    future: asyncio.Future = field(repr=False)

    @property
    def key(self) -> tuple:
        return (self.n, self.temperature, self.max_tokens)


class PolicyServer:
    """The served policy: an ``EmbeddedSampler``, its micro-batching worker and weight reloads."""

    def __init__(self, model_name: str = DEFAULT_MODEL_NAME, max_batch: int = 64):
        from orchestrator.serve.policy import EmbeddedSampler  # torch

        self.model_name, self.max_batch = model_name, max_batch
        self.sampler = EmbeddedSampler()
        self.paths: dict[int, str] = {}
        self._queue: deque[_Pending] = deque()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._reload_lock: asyncio.Lock | None = None
        self.stats = {
            "requests": 0,
            "completed": 0,
            "cancelled": 0,
            "errors": 0,
            "sample_calls": 0,
            "prompts_sampled": 0,
            "reloads": 0,
            "disconnect_cancels": 0,
        }

    # -- weights ----------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.sampler.version >= 0

    def load_blocking(self, path: str | os.PathLike, version: int, replace: bool = False) -> None:
        """Load ``path`` as ``version`` (startup, or from a worker thread); ``replace``: even if
        older than the current version."""
        self.sampler.reload(path, version, replace=replace)
        self.paths[version] = str(path)

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:  # one load at a time; the sampler keeps serving meanwhile
            current = self.sampler.version
            # A lower version from the same run is an out-of-order load: ignored. From another
            # weights dir it is a new run reusing this server: loaded.
            other_run = Path(path).parent != Path(self.paths.get(current, path)).parent
            if version > current or not self.loaded or other_run:
                await asyncio.to_thread(self.load_blocking, path, version, other_run)
                self.stats["reloads"] += 1
            now = self.sampler.version
        return {"version": now, "requested": version, "ignored": version < now, "path": self.paths.get(now)}

    # -- sampling ---------------------------------------------------------------------------------
    def render(self, params: CompletionParams) -> list[str]:
        """Prompt texts of a request, validated against the tokenizer and the position table."""
        from orchestrator.serve.tokenizer import TokenizerError, decode, encode_prompt

        model, _ = self.sampler.current()
        config = model.config
        texts = []
        for i, prompt in enumerate(params.prompts):
            try:
                if isinstance(prompt, str):
                    text, ids = prompt, encode_prompt(prompt)
                else:
                    text = decode(prompt)
                    ids = encode_prompt(text)
                    if ids != list(prompt):
                        raise RequestError(
                            f"prompt {i}: token ids must be a rendered prompt [BOS, chars..., SEP] "
                            f"(e.g. {ids}), got {list(prompt)}"
                        )
            except TokenizerError as exc:
                raise RequestError(f"prompt {i}: {exc}") from None
            if config.arch == "transformer":
                if len(ids) > config.max_prompt:
                    raise RequestError(
                        f"prompt {i} has {len(ids)} tokens; the policy takes at most {config.max_prompt}"
                    )
                cap = config.max_len - config.max_prompt + 1
                if params.max_tokens > cap:
                    raise RequestError(f"'max_tokens' must be <= {cap} for this policy, got {params.max_tokens}")
            texts.append(text)
        return texts

    async def sample(self, params: CompletionParams, texts: list[str]):
        """Per prompt, ``n`` ``SampledCompletion``s (all from one weight version)."""
        base = params.seed if params.seed is not None else int.from_bytes(os.urandom(6), "little")
        loop = asyncio.get_running_loop()
        item = _Pending(
            texts,
            [base + i for i in range(len(texts))],
            params.n,
            params.temperature,
            params.max_tokens,
            loop.create_future(),
        )
        self._queue.append(item)
        self._ensure_worker()
        self._wake.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            raise

    def _ensure_worker(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="orch-serve-sampler")

    async def _work(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._take_batch()
                if batch:
                    await self._sample_batch(batch)

    def _take_batch(self) -> list[_Pending]:
        """Live requests sharing the oldest request's sampling key, up to max_batch prompts."""
        queue = self._queue
        while queue and queue[0].future.done():  # withdrawn (client gone)
            queue.popleft()
        if not queue:
            return []
        key, batch, rest, prompts = queue[0].key, [], deque(), 0
        while queue:
            item = queue.popleft()
            if item.future.done():
                continue
            if item.key == key and (not batch or prompts + len(item.prompts) <= self.max_batch):
                batch.append(item)
                prompts += len(item.prompts)
            else:
                rest.append(item)
        self._queue = rest
        return batch

    async def _sample_batch(self, batch: list[_Pending]) -> None:
        prompts = [p for item in batch for p in item.prompts]
        seeds = [s for item in batch for s in item.seeds]
        n, temperature, max_tokens = batch[0].key
        self.stats["sample_calls"] += 1
        self.stats["prompts_sampled"] += len(prompts)
        try:
            groups = await asyncio.to_thread(
                self.sampler.sample_groups, prompts, n, temperature=temperature, max_new_tokens=max_tokens, seeds=seeds
            )
        except Exception as exc:  # noqa: BLE001 - answered to every request of the batch
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        at = 0
        for item in batch:
            part = groups[at : at + len(item.prompts)]
            at += len(item.prompts)
            if not item.future.done():
                item.future.set_result(part)

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)


def _error(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status_code=status)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise ProtocolError(f"invalid JSON body: {exc}") from None


def create_app(server: PolicyServer) -> Starlette:
    """The starlette app of one `orch serve` process (``app.state.server`` is ``server``)."""
    from orchestrator.serve.tokenizer import decode

    def token_text(token_id: int) -> str:
        return decode([token_id])

    async def completions(request: Request) -> JSONResponse:
        server.stats["requests"] += 1
        try:
            params = parse_completion_request(await _json(request))
        except ProtocolError as exc:
            server.stats["errors"] += 1
            return _error(str(exc), 400)
        if params.model is not None and params.model != server.model_name:
            server.stats["errors"] += 1
            return _error(
                f"model {params.model!r} does not exist; this server serves {server.model_name!r}",
                404,
                "model_not_found",
            )
        if not server.loaded:
            server.stats["errors"] += 1
            return _error("no weights loaded yet: POST /update_weights first", 503, "no_weights")
        try:
            texts = server.render(params)
            groups = await server.sample(params, texts)
        except (RequestError, ValueError) as exc:
            server.stats["errors"] += 1
            return _error(str(exc), 400)
        choices, version, sampled = [], None, 0
        for p, group in enumerate(groups):
            for k, c in enumerate(group):
                version = c.policy_version if version is None else min(version, c.policy_version)
                sampled += len(c.completion_ids)
                choices.append(
                    choice_body(
                        p * params.n + k,
                        c.prompt_ids,
                        c.completion_ids,
                        c.logprobs,
                        c.text,
                        c.finished,
                        with_logprobs=params.logprobs is not None,
                        tokens_as_ids=params.tokens_as_ids,
                        token_text=token_text,
                    )
                )
        prompt_tokens = sum(len(group[0].prompt_ids) for group in groups)
        server.stats["completed"] += 1
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": server.model_name,
                "policy_version": version,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": sampled,
                    "total_tokens": prompt_tokens + sampled,
                },
            }
        )

    async def update_weights(request: Request) -> JSONResponse:
        from orchestrator.rundir import is_stable

        try:
            body = await _json(request)
            if not isinstance(body, dict):
                raise ProtocolError("body must be a JSON object")
            path, version = body.get("path"), body.get("version")
            if not isinstance(path, str) or not path:
                raise ProtocolError("'path' must be the weights directory (a string)")
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise ProtocolError(f"'version' must be a non-negative integer, got {version!r}")
        except ProtocolError as exc:
            return _error(str(exc), 400)
        if not is_stable(path):
            return _error(f"{path} is not a published weights directory (no STABLE marker)", 409, "not_published")
        try:
            answer = await server.update_weights(path, version)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the old weights stay current
            log.exception("update_weights %s failed", path)
            return _error(f"loading {path} failed: {type(exc).__name__}: {exc}", 500, "load_failed")
        return JSONResponse(answer)

    async def version(request: Request) -> JSONResponse:
        v = server.sampler.version
        return JSONResponse({"version": v, "path": server.paths.get(v)})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {"status": "ok", "version": server.sampler.version, "model": server.model_name, "loaded": server.loaded}
        )

    async def models(request: Request) -> JSONResponse:
        v = server.sampler.version
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "orch",
                        "root": server.paths.get(v),
                        "policy_version": v,
                    }
                ],
            }
        )

    app = disconnect_cancelling_app(
        [
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/update_weights", update_weights, methods=["POST"]),
            Route("/version", version, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
        ],
        server.stats,
    )
    app.state.server = server
    return app


_STEP_DIR = re.compile(r"step_(\d+)$")


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = pick a free port.")
@click.option(
    "--weights",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="published weights dir to start with (e.g. runs/R/weights/step_0); else wait for /update_weights",
)
@click.option("--version", "version", type=click.IntRange(0), help="version of --weights (default: N of step_N)")
@click.option("--model-name", default=DEFAULT_MODEL_NAME, show_default=True, help="the served model id")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(1), help="prompts per sampling call")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1), help="torch intra-op threads")
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def serve_command(host, port, weights, version, model_name, max_batch, threads, log_level) -> None:
    """OpenAI-compatible server of its char-level policy (POST /v1/completions, POST /update_weights)."""
    import torch

    torch.set_num_threads(threads)
    server = PolicyServer(model_name, max_batch)
    if weights is not None:
        if version is None:
            match = _STEP_DIR.search(weights.name)
            if match is None:
                raise click.BadParameter(
                    "cannot tell the version from the name; pass --version", param_hint="--weights"
                )
            version = int(match.group(1))
        try:
            server.load_blocking(weights, version)
        except (OSError, ValueError, RuntimeError) as exc:
            raise click.ClickException(f"cannot load {weights}: {exc}") from None
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")

    def ready(base_url: str) -> None:
        click.echo(f"orch serve: listening on {base_url} (model {model_name}, version {server.sampler.version})")

    serve_command_line(create_app(server), "serve", host=host, port=port, log_level=log_level, on_ready=ready)


if __name__ == "__main__":  # python -m orchestrator.serve.server
    serve_command()

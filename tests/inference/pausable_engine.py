"""A stand-in for a vLLM server's engine as update_mode interrupt drives it: streamed
completions whose every token names the weight version that sampled it, `/pause?mode=abort`
(running requests end with finish_reason "abort", new ones are held until `/resume`), reloads
by `/collective_rpc`. A request spends `admit_s` (its own, from the prompt's first id) between
arriving and entering the engine, so that a pause can find it not admitted yet, as vLLM's can.
With `fail_after_next_resume` it answers every completion after its next `/resume` with HTTP
503, as a server that broke between the abort and the continuation. (The real server:
test_vllm_interrupt.py; this one is fast and its timing is the test's.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TOKEN_S = 0.005


def token_of(version: int) -> int:
    """The token a version samples (the engine's only token: a test reads versions off ids)."""
    return 10 + version


def logprob_of(version: int) -> float:
    return -0.1 * (version + 1)


@dataclass(eq=False)
class _Run:
    aborted: bool = False


@dataclass
class PausableEngine:
    version: int = 0
    fail_after_next_resume: bool = False
    failed_resets: int = 0  # the next resets of the prefix cache that fail (success false)
    failed_reloads: int = 0  # the next reloads that fail (HTTP 500), the weights unchanged
    stagger: int = 0  # choice c of a request starts sampling c * stagger steps after choice 0
    failing: bool = False
    # requests are admitted only once the engine holds this version: a test keeps a request
    # unadmitted until the reload it wants to find it so
    admit_from_version: int = 0
    paused: bool = False
    received: int = 0  # completion requests that reached the server
    sessions: list[str | None] = field(default_factory=list)  # each one's X-Session-ID header
    admitted_at: list[int] = field(default_factory=list)  # the version each admitted request started under
    running: list[_Run] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/collective_rpc", self.reload, methods=["POST"]),
                Route("/reset_prefix_cache", self.reset, methods=["POST"]),
                Route("/health", self.health),
            ]
        )

    async def completions(self, request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        assert body.get("stream") is True, body
        self.received += 1
        self.sessions.append(request.headers.get("x-session-id"))
        if self.failing:
            return JSONResponse({"error": {"message": "engine dead", "code": 503}}, status_code=503)
        prompt = body["prompt"]

        n, length = body["n"], body["max_tokens"]

        async def stream():
            await asyncio.sleep(prompt[0] / 1000)  # admit_s: the prompt's first id, in ms
            while self.paused or self.version < self.admit_from_version:  # held, as vLLM holds what it has not admitted
                await asyncio.sleep(0.001)
            run = _Run()
            self.running.append(run)
            self.admitted_at.append(self.version)
            introduced: list[int] = []  # choices whose first part (with the prompt's ids) was sent
            try:
                for step in range(length + (n - 1) * self.stagger):
                    await asyncio.sleep(TOKEN_S)
                    if run.aborted:
                        running = [c for c in range(n) if step - c * self.stagger < length]
                        yield _chunk([(c, None, "abort") for c in running], prompt, introduced)
                        break
                    sampling = [c for c in range(n) if 0 <= step - c * self.stagger < length]
                    ends = {c: "length" if step - c * self.stagger == length - 1 else None for c in sampling}
                    yield _chunk([(c, self.version, ends[c]) for c in sampling], prompt, introduced)
                yield b"data: [DONE]\n\n"
            finally:
                self.running.remove(run)

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({})

    async def pause(self, request: Request) -> JSONResponse:
        assert request.query_params["mode"] == "abort"
        self.paused = True
        for run in self.running:
            run.aborted = True
        while self.running:  # vLLM's abort returns once the aborted requests are out
            await asyncio.sleep(0.001)
        return JSONResponse({})

    async def resume(self, request: Request) -> JSONResponse:
        self.paused = False
        self.failing = self.failing or self.fail_after_next_resume
        return JSONResponse({})

    async def reload(self, request: Request) -> JSONResponse:
        assert self.paused
        if self.failed_reloads:
            self.failed_reloads -= 1
            return JSONResponse({"error": "reload failed"}, status_code=500)
        path = (await request.json())["kwargs"]["weights_path"]
        self.version = int(Path(path).name.split("_")[1])
        return JSONResponse({})

    async def reset(self, request: Request) -> JSONResponse:
        if self.failed_resets:
            self.failed_resets -= 1
            return JSONResponse({"success": False})
        return JSONResponse({"success": True})


def _chunk(parts: list[tuple[int, int | None, str | None]], prompt: list[int], introduced: list[int]) -> bytes:
    """A streamed chunk: a part (index, version that sampled its token or None, finish reason)
    per choice; a choice's first part carries the prompt's ids, as vLLM's does."""
    choices = []
    for index, version, finish in parts:
        part: dict = {"index": index, "text": "", "finish_reason": finish}
        part["logprobs"] = {"token_logprobs": [], "tokens": []}
        if version is not None:
            part.update(text="x", token_ids=[token_of(version)])
            part["logprobs"] = {"token_logprobs": [logprob_of(version)], "tokens": [f"token_id:{token_of(version)}"]}
        if index not in introduced:
            introduced.append(index)
            part["prompt_token_ids"] = prompt
        choices.append(part)
    return b"data: " + orjson.dumps({"choices": choices}) + b"\n\n"

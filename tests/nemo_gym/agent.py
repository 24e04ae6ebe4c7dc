"""A NeMo Gym agent server as its HTTP protocol has it (what `simple_agent` does, without NeMo Gym):
``POST /run`` with a task row calls the model server's ``POST /v1/responses`` with the row's
``responses_create_params`` (cookies none, the body as given, the input grown by each output),
then scores the last output's text and answers the row with ``response`` and ``reward``.

A row's ``turns`` (default 1) is how many model calls it makes: after each but the last, the
model's output and a user message ``"again"`` are appended to the input. Its reward is 1.0 where
the last text equals the row's ``answer``, else 0.0; a row with ``"fail": true`` answers 500."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def last_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] for part in item.get("content", []))


def agent_app(model_url: str, seen: list[dict[str, Any]]) -> Starlette:
    """The agent, calling the model server at `model_url`; every /v1/responses body it sent goes to `seen`."""

    async def run(request: Request) -> JSONResponse:
        row = await request.json()
        if row.get("fail"):
            return JSONResponse({"detail": "the resources server failed"}, status_code=500)
        params = dict(row["responses_create_params"])
        items = params["input"] if isinstance(params["input"], list) else [{"role": "user", "content": params["input"]}]
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            for turn in range(row.get("turns", 1)):
                body = {**params, "input": items}
                seen.append(body)
                answered = await http.post(model_url + "/v1/responses", json=body)
                if answered.status_code != 200:
                    return JSONResponse({"detail": answered.text}, status_code=500)
                response = answered.json()
                items = [*items, *response["output"]]
                if turn + 1 < row.get("turns", 1):
                    items.append({"role": "user", "content": "again", "type": "message"})
        reward = 1.0 if last_text(response) == row.get("answer") else 0.0
        return JSONResponse({**row, "response": response, "reward": reward})

    return Starlette(routes=[Route("/run", run, methods=["POST"])])

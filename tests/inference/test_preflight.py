"""The pre-flight check of given endpoints (orchestrator.inference.preflight), against real HTTP
servers on loopback: `orch serve`, and starlette apps that answer as the cases need."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from orchestrator.envs.server import running_server
from orchestrator.inference.preflight import PreflightError, check_endpoints
from tests.inference.util import serving
from tests.support.cli import orch

MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}


def _check(urls, weight_sync="orch", timeout_s=2.0):
    return asyncio.run(check_endpoints(urls, weight_sync, timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app(routes: dict[str, object], openapi_paths: list[str] | None = None) -> Starlette:
    """An app answering each path with a JSON body, or (status, text) for an error."""

    def answer(value):
        async def handler(request):
            if isinstance(value, tuple):
                return PlainTextResponse(value[1], status_code=value[0])
            return JSONResponse(value)

        return handler

    if openapi_paths is not None:
        routes = {**routes, "/openapi.json": {"openapi": "3.1.0", "paths": {p: {} for p in openapi_paths}}}
    return Starlette(routes=[Route(path, answer(value)) for path, value in routes.items()])


def test_a_refused_connection_is_one_line_at_once():
    """Nothing listens there: waiting out the bound would not change it."""
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(PreflightError) as refused:
        _check([url], timeout_s=60.0)  # a retry until the bound would outlast the test's own timeout
    assert str(refused.value) == (
        f"inference endpoint {url} cannot serve the run: GET /v1/models got connection refused: nothing listens there"
    )


def test_an_endpoint_that_never_answers_is_one_line_at_the_bound():
    """A socket that listens but is never served: the connection is made, no answer comes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(PreflightError) as refused:
            _check([url], timeout_s=1.0)
    assert str(refused.value).startswith(
        f"inference endpoint {url} cannot serve the run: GET /v1/models got no answer within 1s (ReadTimeout"
    )


def test_orch_serve_is_recognised_and_a_vllm_weight_sync_named_wrong():
    with serving() as server:
        assert _check([server.base_url]) == {server.base_url: "orch"}
        assert _check([server.base_url], weight_sync="none") == {server.base_url: "orch"}
        with pytest.raises(PreflightError) as refused:
            _check([server.base_url], weight_sync="vllm_reload")
    assert str(refused.value) == (
        f"inference endpoint {server.base_url} is an `orch serve` server (from its routes), whose weights "
        "weight_sync 'vllm_reload' cannot load: use --set inference.openai.weight_sync=orch"
    )


def test_a_vllm_server_with_the_default_weight_sync_names_the_ones_to_use():
    vllm_like = _app(
        {"/v1/models": MODELS, "/health": {}, "/version": {"version": "0.32.0"}},
        openapi_paths=["/v1/completions", "/pause", "/collective_rpc", "/health"],
    )
    with running_server(vllm_like) as server:
        with pytest.raises(PreflightError, match=r"is a vLLM server \(from its routes\)") as refused:
            _check([server.base_url])
        assert str(refused.value).endswith(
            "use --set inference.openai.weight_sync=vllm_reload or inference.openai.weight_sync=vllm_lora "
            "or inference.openai.weight_sync=vllm_push"
        )
        assert _check([server.base_url], weight_sync="vllm_lora") == {server.base_url: "vllm"}


def test_a_plugin_trainers_own_weight_format_is_named_as_it_is():
    with serving() as server:
        with pytest.raises(PreflightError) as refused:
            asyncio.run(check_endpoints([server.base_url], "orch", 2.0, weight_format="my_format"))
    assert str(refused.value).startswith(
        f"inference endpoint {server.base_url} is an `orch serve` server (from its routes), which loads "
        "`orch serve`'s own policy files, not the 'my_format' the trainer publishes: "
    )


def test_a_permanent_error_is_not_retried_until_the_bound():
    for status, body in ((500, "engine is dead"), (404, "no such route"), (401, "bad key")):
        with running_server(_app({"/v1/models": (status, body)})) as server:
            start = time.monotonic()
            with pytest.raises(PreflightError) as refused:
                _check([server.base_url], timeout_s=10.0)
            assert time.monotonic() - start < 3.0, status  # the same 500 twice is permanent
            assert f"GET /v1/models answered HTTP {status}: {body}" in str(refused.value)


@pytest.mark.parametrize(
    "transient",
    [
        [(503, "loading"), (429, "slow down")],
        [(503, "loading")] * 3,  # only a repeated HTTP 500 is permanent: a loading server's 503 is not
    ],
)
def test_a_transient_error_is_asked_again(transient):
    answers = iter(transient)

    async def models(request):
        status_body = next(answers, None)
        if status_body is None:
            return JSONResponse(MODELS)
        return PlainTextResponse(status_body[1], status_code=status_body[0])

    with running_server(Starlette(routes=[Route("/v1/models", models)])) as server:
        assert _check([server.base_url], timeout_s=5.0) == {server.base_url: None}


def test_orch_run_against_a_dead_endpoint_fails_in_seconds_before_the_run_dir_exists(tmp_path):
    from orchestrator.hf.tiny_model import build_untrained

    model, tokenizer = build_untrained()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    result = orch(
        "run", "--inference", url, "--runs-dir", str(tmp_path / "runs"), "--name", "r", "--max-steps", "1",
        "--set", f"model.path={tmp_path / 'model'}", "--set", "inference.openai.preflight_timeout_s=2",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"orch: error: inference endpoint {url} cannot serve the run")
    assert not (tmp_path / "runs" / "r").exists()
    assert time.monotonic() - start < 60

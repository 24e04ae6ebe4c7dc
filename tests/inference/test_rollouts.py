"""EndpointsBackend: episodes from an endpoint, consistent with the policy and honest about versions."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from orchestrator.contracts import InProcessEnv, RolloutRequest
from orchestrator.envs.client import HttpEnvClient
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.envs.server import create_app, running_server
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.endpoints_backend import EndpointsBackend
from orchestrator.serve.policy import load_policy, sequence_logprobs
from orchestrator.serve.tokenizer import decode, encode_prompt, task_prompt_ids
from tests.inference.util import publish, run, serving


@contextlib.contextmanager
def _rollout_env(where: str, env: ReverseTextEnv):
    if where == "in-process":
        yield lambda: InProcessEnv(env)
    else:  # the same env behind `orch env-server`
        with running_server(create_app(env)) as server:
            yield lambda: HttpEnvClient(server.base_url)


@pytest.mark.parametrize("where", ["in-process", "env-server"])
def test_episodes_carry_the_endpoints_tokens_logprobs_and_version(tmp_path, where):
    publish(tmp_path, 0)
    env = ReverseTextEnv(seed=3)
    checks = []
    with serving() as a, serving() as b, _rollout_env(where, env) as rollout_env:

        async def main():
            client = InferenceClient([a.base_url, b.base_url])
            backend = EndpointsBackend(
                tmp_path,
                {"reverse_text": rollout_env()},
                client,
                temperature=0.8,
                max_new_tokens=20,
                seed=5,
                load_timeout_s=5,
                encode_prompt=task_prompt_ids,
            )
            try:
                await backend.load(0, health_check=lambda: checks.append(1))
                eps = await asyncio.gather(
                    *(backend(RolloutRequest(e, e // 4, "reverse_text", e // 4, 0, 0)) for e in range(8))
                )
                publish(tmp_path, 1)
                await backend.load(1)
                later = await backend(RolloutRequest(99, 9, "reverse_text", 9, 0, 1))
                with pytest.raises(TimeoutError, match="step_2"):
                    backend.load_timeout_s = 0.3
                    await backend.load(2, health_check=lambda: checks.append(2))
                return eps, later
            finally:
                await backend.aclose()
                if where == "env-server":
                    await backend.envs["reverse_text"].aclose()

        eps, later = run(main())
    models = {v: load_policy(tmp_path / "weights" / f"step_{v}") for v in (0, 1)}
    for ep in eps + [later]:
        task = env.task(ep.group_id)
        prompt = encode_prompt(task.prompt)
        n = len(prompt)
        assert (
            ep.ok and ep.token_ids[:n].tolist() == prompt and list(ep.mask) == [0] * n + [1] * (len(ep.token_ids) - n)
        )
        assert ep.logprobs[:n].tolist() == [0.0] * n and ep.temperature == 0.8
        completion = ep.token_ids[n:]
        assert ep.reward == env.score(task, decode(completion))
        version = ep.policy_start
        assert ep.policy_end == version == (1 if ep is later else 0)
        expected = sequence_logprobs(models[version], ep.token_ids.tolist(), n, 0.8)
        assert ep.logprobs[n:].tolist() == pytest.approx(expected, abs=1e-4)
    assert 2 in checks  # the trainer's health is checked while waiting for a publication


@pytest.mark.parametrize("status, fails_at_once", [(403, True), (400, True), (409, False), (404, False)])
def test_a_load_every_endpoint_refuses_for_good_fails_at_once(tmp_path, status, fails_at_once):
    """A refusal that cannot pass later (400, 403) is not retried until the timeout; one that may
    (409, 404: weights not yet visible to a server on a lagging shared file system) is."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from orchestrator.inference.client import InferenceError, InferenceRequestError

    refusals = []

    async def refuse(request):
        refusals.append(request)
        return JSONResponse({"error": {"message": "not a published weights directory"}}, status_code=status)

    publish(tmp_path, 0)
    with running_server(Starlette(routes=[Route("/update_weights", refuse, methods=["POST"])])) as server:

        async def main():
            client = InferenceClient([server.base_url])
            backend = EndpointsBackend(
                tmp_path,
                {},
                client,
                temperature=1.0,
                max_new_tokens=4,
                seed=0,
                load_timeout_s=3 if not fails_at_once else 60,
                encode_prompt=task_prompt_ids,
            )
            try:
                with pytest.raises(InferenceError, match=f"HTTP {status}.*not a published weights directory") as err:
                    await backend.load(0)
                return err.value
            finally:
                await client.aclose()

        error = run(main())
    assert isinstance(error, InferenceRequestError) == fails_at_once
    # refused for good: asked once, not again until the 60 s load timeout; else asked again
    assert len(refusals) == 1 if fails_at_once else len(refusals) > 1


@pytest.mark.parametrize("backoff_s, max_backoff_s, most_hits", [(0.25, 1.0, 7), (0.5, 0.5, 8)])
def test_the_first_weights_are_waited_for_with_backoff_and_one_warning(
    tmp_path, capsys, backoff_s, max_backoff_s, most_hits
):
    """Endpoints still starting: the load is retried with the client's backoff (not every half
    second for the whole publish timeout), and the wait is announced once."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from orchestrator.inference.client import InferenceError

    hits = []

    async def not_yet(request):
        hits.append(request)
        return JSONResponse({"error": {"message": "still starting"}}, status_code=409)

    publish(tmp_path, 0)
    with running_server(Starlette(routes=[Route("/update_weights", not_yet, methods=["POST"])])) as server:

        async def main():
            client = InferenceClient([server.base_url], backoff_s=backoff_s, max_backoff_s=max_backoff_s)
            backend = EndpointsBackend(
                tmp_path, {}, client, temperature=1.0, max_new_tokens=4, seed=0, load_timeout_s=3.5
            )
            try:
                with pytest.raises(InferenceError, match="HTTP 409"):
                    await backend.load(0)
            finally:
                await client.aclose()

        run(main())
    # 0.25 doubling to 1: pauses 0.25, 0.5, 1, 1, 1, about 6 tries in 3.5 s (every 0.5 s would be 8)
    assert 4 <= len(hits) <= most_hits, len(hits)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("orch: warning:")]
    assert len(warnings) == 1 and re.search(
        r"HTTP 409.*; retrying for up to \d+s more \(endpoints may be starting\)$", warnings[0]
    ), warnings

"""A router in front of engines (inference.openai.routers): the run samples through a real
vllm-router (consistent_hash on X-Session-ID, as fleets front vLLM), each group's requests name
the group as their session so the router keeps them on one engine, and every weight load goes
to each engine directly; under update_mode interrupt every token still has the version that
sampled it (docs/scaling-out.md, "Behind a router"). The engines are stand-ins whose tokens name
their version (tests/inference/pausable_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.envs.server import running_server
from orchestrator.inference.client import InferenceClient, InferenceError
from orchestrator.inference.endpoints_config import EndpointsSettings, RouterSection
from tests.inference.pausable_engine import PausableEngine, logprob_of, token_of
from tests.inference.test_interrupt import per_token
from tests.inference.util import run, vllm_router, weight_dirs


def test_through_a_sticky_router_each_group_stays_on_one_engine_and_every_token_has_its_version(tmp_path):
    engines, dirs = [PausableEngine(), PausableEngine()], weight_dirs(tmp_path, range(5))
    groups = 16

    async def main(router: str, engine_urls: list[str]):
        routers = [RouterSection(url=router, engines=engine_urls)]
        async with InferenceClient([], weight_sync="vllm_reload", update_mode="interrupt", routers=routers) as client:
            await client.load(0, dirs[0])
            flight = [
                asyncio.ensure_future(client.complete([g, 1, 2], n=2, max_tokens=30, seed=g * 3 + r, pin=f"g{g}"))
                for g in range(groups)
                for r in range(3)
            ]
            ep = client.endpoints[0]
            for v in range(1, 5):
                while ep.sending - len(ep.unstarted) < 1:  # a stream with its first token: the reload cuts it
                    await asyncio.sleep(0.005)
                await client.load(v, dirs[v])
            return await asyncio.gather(*flight), ep.version

    with running_server(engines[0].app()) as first, running_server(engines[1].app()) as second:
        urls = [first.base_url, second.base_url]
        with vllm_router(urls, tmp_path / "router.log") as router:
            done, version = run(main(router, urls))
    assert version == 4 and [e.version for e in engines] == [4, 4]  # each load reached each engine
    seams = 0
    for completion in done:
        for i, choice in enumerate(completion.choices):
            versions = per_token(completion, i)
            assert len(choice.token_ids) == 30 and choice.finish_reason == "length"
            assert choice.token_ids == [token_of(v) for v in versions]  # the version that sampled it
            assert choice.logprobs == [logprob_of(v) for v in versions]
            seams += len(set(versions)) - 1
    assert seams > 0  # reloads did land inside completions, their continuations sent through the router
    # Every request named its group, and the router kept each group on one engine, continuations too.
    served_by = {}
    for index, engine in enumerate(engines):
        for session in engine.sessions:
            assert session is not None and session.startswith("g")
            served_by.setdefault(session, set()).add(index)
    assert sorted(served_by) == sorted(f"g{g}" for g in range(groups))
    assert all(len(on) == 1 for on in served_by.values()), served_by
    assert {index for on in served_by.values() for index in on} == {0, 1}  # 16 groups hashed over both


def test_an_engine_that_fails_a_load_the_other_took_makes_the_next_request_reload_both(tmp_path):
    """Engines at mixed versions: the router's load fails, its version unknown, and its next
    request reloads every engine first, so that request samples with the new version only."""
    engines, dirs = [PausableEngine(), PausableEngine()], weight_dirs(tmp_path, range(2))

    async def main(router: str, engine_urls: list[str]):
        routers = [RouterSection(url=router, engines=engine_urls)]
        async with InferenceClient([], weight_sync="vllm_reload", update_mode="interrupt", routers=routers) as client:
            await client.load(0, dirs[0])
            engines[1].failed_reloads = 1
            with pytest.raises(InferenceError) as failed:
                await client.load(1, dirs[1])
            versions_after_the_failure = [e.version for e in engines]
            completion = await client.complete([0, 1, 2], max_tokens=5, seed=1, pin="g0")
            return str(failed.value), versions_after_the_failure, completion

    with running_server(engines[0].app()) as first, running_server(engines[1].app()) as second:
        urls = [first.base_url, second.base_url]
        with vllm_router(urls, tmp_path / "router.log") as router:
            failure, mixed, completion = run(main(router, urls))
    assert mixed == [1, 0]  # the first engine took version 1, the second did not
    assert "/collective_rpc failed on some of its engines, not all" in failure and urls[1] in failure
    assert [e.version for e in engines] == [1, 1] and not any(e.paused for e in engines)
    assert completion.choices[0].token_ids == [token_of(1)] * 5 and completion.policy_start == 1


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"routers": [{"url": "http://r:1"}], "weight_sync": "vllm_reload"},
            "inference.openai.routers[0] (http://r:1) lists no engines: weight_sync 'vllm_reload' loads each engine",
        ),
        (
            {"routers": [{"url": "http://r:1", "engines": ["not a url"]}], "weight_sync": "vllm_reload"},
            "not a url",
        ),
        (
            {"routers": [{"url": "http://r:1", "engines": ["http://e:1"]}], "endpoints": ["http://e:1/"]},
            "endpoints 'http://e:1/' and 'http://e:1' are the same",
        ),
        (
            {"routers": [{"url": "http://r:1", "engines": ["http://e:1"]}], "launch": {"servers": 1}},
            "give inference.openai.endpoints (or routers) or inference.openai.launch.servers, not both",
        ),
    ],
)
def test_a_router_that_cannot_be_synced_is_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=None) as refused:
        EndpointsSettings.model_validate(settings)
    assert message in str(refused.value)


def test_a_router_without_engines_is_accepted_when_weights_are_managed_outside_orch():
    settings = EndpointsSettings.model_validate({"routers": [{"url": "http://r:1"}], "weight_sync": "none"})
    assert settings.enabled and settings.routers[0].session_header == "X-Session-ID"

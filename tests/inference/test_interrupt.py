"""update_mode interrupt against a stand-in engine (tests/inference/pausable_engine.py) whose
tokens name the version that sampled them: every token's recorded version is that version,
none lost or repeated at a seam, and a reload never waits for a request the engine has not
started (docs/vllm.md, "Weight updates while requests run")."""

from __future__ import annotations

import asyncio
import random

import pytest

from orchestrator.envs.server import running_server
from orchestrator.inference.client import MAX_RESTARTS, InferenceClient, InferenceError, InferenceUnavailable
from tests.inference.pausable_engine import PausableEngine, logprob_of, token_of
from tests.inference.util import run, weight_dirs


def per_token(completion, choice_index: int) -> list[int]:
    runs = completion.choice_versions[choice_index] if completion.choice_versions else ()
    length = len(completion.choices[choice_index].token_ids)
    return [v for v, n in runs for _ in range(n)] or [completion.choice_policy(choice_index)[0]] * length


async def received(engine: PausableEngine, requests: int) -> None:
    """Until the engine has received `requests` completion requests."""
    while engine.received < requests:
        await asyncio.sleep(0.005)


async def every_stream_started(client: InferenceClient, engine: PausableEngine, requests: int) -> None:
    """Until the engine runs `requests` requests and the client has the first token of each."""
    while len(engine.running) < requests or client.endpoints[0].unstarted:
        await asyncio.sleep(0.005)


def test_each_token_has_the_version_that_sampled_it_across_reloads(tmp_path):
    engine, dirs = PausableEngine(), weight_dirs(tmp_path, range(6))
    rng = random.Random(7)
    admits = [rng.randrange(0, 60) for _ in range(24)]  # ms before the engine admits each

    async def main(url):
        async with InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt") as client:
            await client.load(0, dirs[0])
            flight = [
                asyncio.ensure_future(client.complete([admit, 1, 2], n=2, max_tokens=40, seed=i))
                for i, admit in enumerate(admits)
            ]
            ep = client.endpoints[0]
            for v in range(1, 6):
                if v == 1:  # one stream with its first token at least: the first reload interrupts it
                    while ep.sending - len(ep.unstarted) < 1:
                        await asyncio.sleep(0.005)
                else:
                    await asyncio.sleep(0.04)
                await client.load(v, dirs[v])
            return await asyncio.gather(*flight)

    with running_server(engine.app()) as server:
        done = run(main(server.base_url))
    seams = 0
    for admit, completion in zip(admits, done):
        every = []
        for i, choice in enumerate(completion.choices):
            versions = per_token(completion, i)
            assert choice.prompt_ids == [admit, 1, 2] and choice.finish_reason == "length"
            assert len(choice.token_ids) == len(choice.logprobs) == 40  # none lost, none twice
            assert choice.token_ids == [token_of(v) for v in versions]  # the version that sampled it
            assert choice.logprobs == [logprob_of(v) for v in versions]
            seams += len(set(versions)) - 1
            every += versions
        assert (completion.policy_start, completion.policy_end) == (min(every), max(every))
    assert seams > 0  # reloads did land inside completions
    assert engine.received > len(admits)  # continuations, and requests sent again


def test_a_reload_does_not_wait_for_a_request_the_engine_has_not_started(tmp_path):
    engine, dirs = PausableEngine(admit_from_version=1), weight_dirs(tmp_path, range(2))

    async def main(url):
        async with InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt") as client:
            await client.load(0, dirs[0])
            late = asyncio.ensure_future(client.complete([0, 1], max_tokens=5, seed=1))  # not admitted before v1
            await received(engine, 1)
            await client.load(1, dirs[1])
            return await late, engine.received

    with running_server(engine.app()) as server:
        completion, received_after_load = run(main(server.base_url))
    # ended by the reload before it started, sent again after it: all of it by version 1
    assert completion.choices[0].token_ids == [token_of(1)] * 5
    assert (completion.policy_start, completion.policy_end, completion.choice_versions) == (1, 1, ())
    assert engine.received == 2 and engine.admitted_at[-1] == 1


def test_a_server_failing_between_abort_and_continue_leaves_each_continuation_to_another(tmp_path):
    broken, other = PausableEngine(), PausableEngine()
    dirs = weight_dirs(tmp_path, range(2))

    async def main(urls):
        async with InferenceClient(urls, weight_sync="vllm_reload", update_mode="interrupt", backoff_s=0.05) as client:
            await client.load(0, dirs[0])
            broken.fail_after_next_resume = True
            flight = [  # one group, pinned to the first endpoint: the one that breaks
                asyncio.ensure_future(client.complete([0, 1], max_tokens=60, seed=i, pin="group")) for i in range(4)
            ]
            await every_stream_started(client, broken, 4)
            await client.load(1, dirs[1])
            return await asyncio.gather(*flight)

    with running_server(broken.app()) as a, running_server(other.app()) as b:
        done = run(main([a.base_url, b.base_url]))
        for completion in done:
            (choice,) = completion.choices
            versions = per_token(completion, 0)
            assert len(choice.token_ids) == 60 and choice.token_ids == [token_of(v) for v in versions]
            assert versions[0] == 0 and versions[-1] == 1  # begun on the broken one, ended on the other
            assert completion.endpoint == b.base_url
    assert broken.admitted_at == [0] * 4 and other.received == 4


def test_with_no_other_server_the_continuation_fails_as_the_requests_failure(tmp_path):
    broken = PausableEngine()
    dirs = weight_dirs(tmp_path, range(2))

    async def main(url):
        async with InferenceClient(
            [url], weight_sync="vllm_reload", update_mode="interrupt", backoff_s=0.05, max_backoff_s=0.1
        ) as client:
            await client.load(0, dirs[0])
            broken.fail_after_next_resume = True
            flight = asyncio.ensure_future(client.complete([0, 1], max_tokens=60, seed=1))
            await every_stream_started(client, broken, 1)
            await client.load(1, dirs[1])
            with pytest.raises(InferenceUnavailable, match="continued completion failed after 3 attempt"):
                await flight

    with running_server(broken.app()) as a:
        run(main(a.base_url))


def test_a_reload_failing_after_its_pause_leaves_no_request_held_nor_a_wrong_version(tmp_path):
    """The pause went through and the reload failed after it: the endpoint's version is unknown,
    so its next request reloads it first (that reload's /resume ends the pause), with the version
    the client still targets (a version refused for good is not the target: the one before)."""
    engine = PausableEngine()
    dirs = weight_dirs(tmp_path, range(2))

    async def main(url):
        async with InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt", backoff_s=0.05) as client:
            await client.load(0, dirs[0])
            engine.failed_resets = 1
            with pytest.raises(InferenceError, match="reset_prefix_cache failed"):
                await client.load(1, dirs[1])
            assert engine.paused and client.endpoints[0].version == -1
            completion = await client.complete([0, 1], max_tokens=5, seed=1)
            return completion, engine.paused

    with running_server(engine.app()) as server:
        completion, paused = run(main(server.base_url))
    # the server's state failed, not the request: the endpoint was down for a backoff, then
    # reloaded to the version the client targets
    assert not paused and completion.policy_start == completion.policy_end == 1
    assert completion.choices[0].token_ids == [token_of(1)] * 5 and engine.version == 1


def test_a_choice_aborted_before_its_first_token_has_the_version_that_sampled_it_whole(tmp_path):
    """n=2, the second choice starting later (as an engine may schedule a request's choices): a
    reload after the first choice's first tokens aborts the second with none; each choice's
    oldest and newest versions are its own, not the completion's."""
    engine = PausableEngine(stagger=40)
    dirs = weight_dirs(tmp_path, range(2))

    async def main(url):
        async with InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt") as client:
            await client.load(0, dirs[0])
            flight = asyncio.ensure_future(client.complete([0, 1], n=2, max_tokens=20, seed=1))
            await every_stream_started(client, engine, 1)
            await client.load(1, dirs[1])
            return await flight

    with running_server(engine.app()) as server:
        completion = run(main(server.base_url))
    first, second = completion.choices
    assert (completion.policy_start, completion.policy_end) == (0, 1)
    assert completion.choice_policy(0) == (0, 1) and completion.choice_policy(1) == (1, 1)
    assert second.token_ids == [token_of(1)] * 20 and per_token(completion, 1) == [1] * 20
    assert first.token_ids == [token_of(v) for v in per_token(completion, 0)] and len(first.token_ids) == 20


def test_a_request_restarted_max_restarts_times_is_waited_for_then_continued(tmp_path):
    """A request that does not start before a reload is not restarted at every reload: after
    MAX_RESTARTS the next reload waits for its first token, then aborts and continues it."""
    engine = PausableEngine(admit_from_version=MAX_RESTARTS)  # not admitted before the MAX_RESTARTS-th reload
    dirs = weight_dirs(tmp_path, range(MAX_RESTARTS + 2))

    async def main(url):
        async with InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt") as client:
            await client.load(0, dirs[0])
            slow = asyncio.ensure_future(client.complete([0, 1], max_tokens=100, seed=1))
            for v in range(1, MAX_RESTARTS + 2):
                await received(engine, v)  # sent for the v-th time: not admitted before v == MAX_RESTARTS
                await client.load(v, dirs[v])
            return await slow

    with running_server(engine.app()) as server:
        completion = run(main(server.base_url))
    waited = MAX_RESTARTS  # the version it started with, once no reload ended it any more
    assert per_token(completion, 0)[0] == waited and per_token(completion, 0)[-1] == waited + 1
    assert completion.choices[0].token_ids == [token_of(v) for v in per_token(completion, 0)]
    assert engine.received == MAX_RESTARTS + 2  # sent, restarted MAX_RESTARTS times, continued once

"""`update_mode = "keep"` against stand-in engines (tests/inference/fleet_standin.py, vLLM 0.32's
token-in, token-out route and its weight-sync routes): a load freezes the running requests, the
engine continues them with the new weights, and every token's recorded version is the one that
sampled it, read from the engine's labelled spans (docs/vllm.md, "Weight updates while requests
run"). The real server: test_vllm_keep.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from orchestrator.inference.client import InferenceClient, InferenceRequestError
from orchestrator.inference.protocol import ProtocolError, parse_generated
from tests.inference.fleet_standin import fleet_process, length_of, token_of
from tests.inference.test_interrupt import per_token
from tests.inference.util import weight_dirs

MAX_TOKENS = 64
STEP_S = 0.002


def long_seed(max_tokens: int) -> int:
    """A seed whose completion runs to max_tokens on the stand-in (its lengths follow the seed)."""
    return next(seed for seed in range(10_000) if length_of(seed, max_tokens) == max_tokens)


async def sampled(http: httpx.AsyncClient) -> int:
    return (await http.get("/stats")).raise_for_status().json()["sampled"]


def test_a_load_freezes_a_kept_completion_and_each_token_has_the_version_that_sampled_it(tmp_path):
    dirs = weight_dirs(tmp_path, range(3))
    seed = long_seed(MAX_TOKENS)

    async def main():
        async with (
            InferenceClient(urls, weight_sync="vllm_reload", update_mode="keep") as client,
            httpx.AsyncClient(base_url=urls[0], timeout=30, trust_env=False) as http,
        ):
            await client.load(0, dirs[0])
            flight = asyncio.ensure_future(client.complete([1, 2, 3], max_tokens=MAX_TOKENS, seed=seed))
            async with asyncio.timeout(30):
                while await sampled(http) < 5:  # a few tokens sampled by version 0
                    await asyncio.sleep(0.005)
            # held where it is (the engine frozen), so that both loads land inside it on any machine
            (await http.post("/pause?mode=keep")).raise_for_status()
            assert not flight.done()
            await client.load(1, dirs[1])
            (await http.post("/pause?mode=keep")).raise_for_status()
            await client.load(2, dirs[2])
            return await asyncio.wait_for(flight, 30), client.endpoints[0]

    with fleet_process(1, 4, STEP_S) as urls:
        done, ep = asyncio.run(main())
    (choice,) = done.choices
    versions = per_token(done, 0)
    assert len(choice.token_ids) == MAX_TOKENS and choice.finish_reason == "length"
    assert choice.token_ids == [token_of(v) for v in versions]  # each token's version is the one that sampled it
    assert versions[0] == 0 and versions[-1] == 2 and versions == sorted(versions)
    assert (done.policy_start, done.policy_end) == (0, 2) and done.choice_policy(0) == (0, 2)
    assert choice.prompt_ids == [1, 2, 3]
    assert ep.version == 2


def test_kept_completions_through_reloads_at_a_small_fleets_shape_have_exact_versions(tmp_path):
    """32 completions in flight on 2 engines of 4 slots, a load every 20 ms: none fails, every
    token's version is exact, and some completions span several versions."""
    dirs = weight_dirs(tmp_path, range(200))

    async def main():
        async with InferenceClient(urls, weight_sync="vllm_reload", update_mode="keep") as client:
            await client.load(0, dirs[0])
            loads_done = asyncio.Event()

            async def loads():
                for version in range(1, 200):
                    await asyncio.sleep(0.02)
                    await client.load(version, dirs[version])
                    if version == 20:
                        loads_done.set()

            reloads = asyncio.ensure_future(loads())
            try:
                await loads_done.wait()
                return await asyncio.gather(
                    *(client.complete([7, k], max_tokens=MAX_TOKENS, seed=k, pin=k) for k in range(32))
                )
            finally:
                reloads.cancel()
                await asyncio.gather(reloads, return_exceptions=True)

    with fleet_process(2, 4, STEP_S) as urls:
        done = asyncio.run(asyncio.wait_for(main(), 120))
    seams = 0
    for completion in done:
        versions = per_token(completion, 0)
        assert completion.choices[0].token_ids == [token_of(v) for v in versions]
        assert versions == sorted(versions)
        seams += len(set(versions)) - 1
    assert seams > 0


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        (None, "no 'weight_versions' in the answer"),
        ([{"version": "1", "start": 0, "end": 2}], "do not cover the 3 tokens in order"),
        ([{"version": "1", "start": 1, "end": 3}], "do not cover the 3 tokens in order"),
        ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 1, "end": 3}], "do not cover"),
    ],
)
def test_a_generate_answer_whose_spans_do_not_cover_its_tokens_is_refused(spans, message):
    content = [{"token": "a", "logprob": -0.5}] * 3
    choice = {"index": 0, "text": "aaa", "token_ids": [5, 6, 7], "logprobs": {"content": content}}
    with pytest.raises(ProtocolError, match=message):
        parse_generated({"choices": [{**choice, "weight_versions": spans}]}, 1)


def test_a_kept_completion_needs_a_prompt_of_token_ids(tmp_path):
    async def main():
        async with InferenceClient(["http://127.0.0.1:9"], weight_sync="vllm_reload", update_mode="keep") as client:
            await client.complete("text", max_tokens=4)

    with pytest.raises(InferenceRequestError, match="update_mode keep samples one prompt of token ids"):
        asyncio.run(main())


def test_a_given_server_without_the_generate_route_is_refused_before_the_run_in_one_line():
    from orchestrator.inference.weight_sync.vllm_check import check_generate_route

    async def main():
        async with InferenceClient(urls, weight_sync="vllm_reload", update_mode="keep") as client:
            await check_generate_route(client, client.endpoints[0])

    with fleet_process(1, 1, STEP_S) as urls, pytest.raises(InferenceRequestError) as refused:
        asyncio.run(main())  # the stand-in answers a GET there 404, as vLLM without --enable-scale-out
    assert "lacks /inference/v1/generate" in str(refused.value) and "--enable-scale-out" in str(refused.value)

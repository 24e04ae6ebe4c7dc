"""Rollout workers: turn an `episode_dispatched` decision into an `episode_completed` input.

A worker is an async callable `(RolloutRequest) -> EpisodeCompleted`; the main loop runs them
through `run_examples` (orchestrator.rollouts.collect). An exception is an episode failure: the
loop turns it into `episode_completed(ok=False, error=...)`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.config import FakeEnvConfig
from orchestrator.core.events import EpisodeCompleted


@dataclass(slots=True, frozen=True)
class RolloutRequest:
    episode_id: int
    group_id: int
    env: str
    task_id: int
    attempt: int
    policy_version: int


class FakeEpisodeError(RuntimeError):
    pass


class FakeEnvRollouts:
    """Seeded synthetic episodes: tokens, rewards, errors and latency from a per-episode RNG.

    `version_now` tells which policy version the (imaginary) sampler holds, so policy_start and
    policy_end are honest about weight updates that land during a slow episode.
    """

    def __init__(self, config: FakeEnvConfig, seed: int, version_now: Callable[[], int]):
        self.config, self.seed, self.version_now = config, seed, version_now

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        cfg = self.config
        rng = random.Random((self.seed << 40) ^ (req.episode_id << 8) ^ req.attempt)
        policy_start = self.version_now()
        if cfg.latency_s > 0:
            jitter = rng.uniform(-cfg.latency_jitter_s, cfg.latency_jitter_s)
            await asyncio.sleep(max(0.0, cfg.latency_s + jitter))
        if cfg.error_rate and rng.random() < cfg.error_rate:
            raise FakeEpisodeError(f"fake env: episode {req.episode_id} failed (error_rate={cfg.error_rate})")
        n_sampled = 0 if cfg.empty_rate and rng.random() < cfg.empty_rate else rng.randint(cfg.min_tokens, cfg.max_tokens)
        noise = rng.randbytes(cfg.prompt_tokens + 2 * n_sampled)  # one draw for tokens and logprobs
        return EpisodeCompleted(
            episode_id=req.episode_id, group_id=req.group_id, ok=True,
            # The task sets a difficulty shared by the group, so groups have reward spread.
            reward=min(1.0, max(0.0, (req.task_id % 7) / 7 + rng.random() * 0.5 - 0.25)),
            token_ids=list(noise[: cfg.prompt_tokens + n_sampled]),
            mask=[0] * cfg.prompt_tokens + [1] * n_sampled,
            logprobs=[0.0] * cfg.prompt_tokens + [-b / 64 for b in noise[cfg.prompt_tokens + n_sampled:]],
            policy_start=policy_start, policy_end=self.version_now(),
        )


class EmbeddedRollouts:
    """reverse_text episodes sampled from the embedded torch policy, off the event loop.

    The sampler starts on `weights/step_0` (the trainer's warm start) and reloads whenever a
    version is published; each episode reports the version it was actually sampled with.
    """

    def __init__(self, run_dir, env, *, temperature: float, max_new_tokens: int, seed: int, load_timeout_s: float):
        from orchestrator.embedded.policy import EmbeddedSampler  # torch: only for this backend

        self.run_dir, self.env, self.seed = run_dir, env, seed
        self.temperature, self.max_new_tokens, self.load_timeout_s = temperature, max_new_tokens, load_timeout_s
        self.sampler = EmbeddedSampler()
        self._loaded = asyncio.Event()
        self._reload_lock = asyncio.Lock()

    async def load(self, version: int, health_check: Callable[[], None] | None = None) -> None:
        """Make `version` current (waits, bounded, for its STABLE marker; `health_check` raises
        if the trainer that should publish it has died)."""
        from orchestrator.embedded.files import is_stable, weights_dir

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

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        await asyncio.wait_for(self._loaded.wait(), self.load_timeout_s)
        task = self.env.task(req.task_id)
        seed = (self.seed << 32) ^ (req.episode_id << 4) ^ req.attempt
        (completion,) = await asyncio.to_thread(
            self.sampler.sample_group, task.prompt, 1, temperature=self.temperature,
            max_new_tokens=self.max_new_tokens, seed=seed,
        )
        version = completion.policy_version
        return EpisodeCompleted(
            episode_id=req.episode_id, group_id=req.group_id, ok=True,
            reward=self.env.score(task, completion.text), token_ids=completion.token_ids,
            mask=completion.mask, logprobs=completion.full_logprobs, policy_start=version,
            policy_end=version, temperature=self.temperature,
        )

"""Rollout workers: turn an `episode_dispatched` decision into an `episode_completed` input.

A worker is an async callable `(RolloutRequest) -> EpisodeCompleted`; the main loop runs them
through `run_examples` (orchestrator.rollouts.collect). An exception is an episode failure: the
loop turns it into `episode_completed(ok=False, error=...)`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import struct
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import NamedTuple

from orchestrator.config import FakeEnvConfig
from orchestrator.core.events import EpisodeCompleted


class RolloutRequest(NamedTuple):
    """What one dispatched episode needs (immutable; a tuple: one is built per episode, and a
    frozen dataclass's field-by-field __init__ cost 2% of the instant pipeline)."""

    episode_id: int
    group_id: int
    env: str
    task_id: int
    attempt: int
    policy_version: int
    # An eval episode (docs/evals.md): sampled by `policy_version` exactly where the backend can
    # hold it, at the eval's own temperature. None for train episodes.
    eval_id: int | None = None
    temperature: float | None = None


class FakeEpisodeError(RuntimeError):
    pass


class FakeEnvRollouts:
    """Seeded synthetic episodes: tokens, rewards, errors and latency from a per-episode hash.

    Everything an episode draws comes from blake2b(seed, episode, attempt), so an episode's
    outcome does not depend on which other episodes ran (and it is cheap: no RNG to seed).
    `version_now` tells which policy version the (imaginary) sampler holds, so policy_start and
    policy_end are honest about weight updates that land during a slow episode.
    """

    def __init__(self, config: FakeEnvConfig, seed: int, version_now: Callable[[], int]):
        self.config, self.seed, self.version_now = config, seed, version_now
        self._draw_size = _UNIFORMS.size + config.prompt_tokens + config.max_tokens  # uniforms, token ids
        # Per episode only the draws differ; each episode gets a copy of its mask, and its
        # sampled logprobs are a slice of a fixed pool at a drawn offset (a list built per token
        # was a tenth of the instant pipeline's time).
        self._masks = [[0] * config.prompt_tokens + [1] * n for n in range(config.max_tokens + 1)]
        self._prompt_logprobs = [0.0] * config.prompt_tokens
        self._logprob_pool = [-((i * 167) % 256) / 64 for i in range(256 + config.max_tokens)]

    def _draws(self, req: RolloutRequest) -> tuple[tuple[int, ...], bytes]:
        key = b"%d/%d/%d" % (self.seed, req.episode_id, req.attempt)
        size = self._draw_size
        raw = hashlib.blake2b(key, digest_size=64).digest()  # block 0 (its salt is all zeros)
        for block in range(1, -(-size // 64)):
            raw += hashlib.blake2b(key, digest_size=64, salt=block.to_bytes(16, "little")).digest()
        return _UNIFORMS.unpack_from(raw), raw[_UNIFORMS.size:size]

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        cfg = self.config
        (latency, error, empty, length, reward, logprob_offset), token_ids = self._draws(req)
        # The fake sampler holds any version: an eval episode is sampled by the one it is pinned to.
        pinned = req.eval_id is not None
        policy_start = req.policy_version if pinned else self.version_now()
        if cfg.latency_s > 0:
            jitter = 2 * latency / _U32 - 1
            await asyncio.sleep(max(0.0, cfg.latency_s + jitter * cfg.latency_jitter_s))
        if error / _U32 < cfg.error_rate:
            raise FakeEpisodeError(f"fake env: episode {req.episode_id} failed (error_rate={cfg.error_rate})")
        n_sampled = 0 if empty / _U32 < cfg.empty_rate else cfg.min_tokens + int(length / _U32 * (cfg.max_tokens - cfg.min_tokens + 1))
        n_total = cfg.prompt_tokens + n_sampled
        offset = logprob_offset % 256
        # Valid by construction (aligned lists, finite floats), so not validated again: an
        # instant env should cost next to nothing beside the orchestrator it exercises.
        return EpisodeCompleted.unvalidated(
            episode_id=req.episode_id, group_id=req.group_id, ok=True,
            # The task sets a difficulty shared by the group, so groups have reward spread.
            reward=min(1.0, max(0.0, (req.task_id % 7) / 7 + reward / _U32 * 0.5 - 0.25)),
            token_ids=list(token_ids[:n_total]),
            mask=self._masks[n_sampled][:],
            logprobs=self._prompt_logprobs + self._logprob_pool[offset:offset + n_sampled],
            policy_start=policy_start, policy_end=policy_start if pinned else self.version_now(),
        )


_UNIFORMS = struct.Struct("<6I")  # latency, error, empty, length, reward, logprob offset: over 2**32
_U32 = 4294967296.0


SAMPLING_THREADS = 32


class EmbeddedRollouts:
    """reverse_text episodes sampled from the embedded torch policy, off the event loop.

    The sampler starts on `weights/step_0` (the trainer's warm start) and reloads whenever a
    version is published; each episode reports the version it was actually sampled with.
    """

    def __init__(self, run_dir, env, *, temperature: float, max_new_tokens: int, seed: int, load_timeout_s: float):
        import torch

        from orchestrator.embedded.policy import EmbeddedSampler  # torch: only for this backend

        # Many small forward passes from several threads: intra-op threads only contend (a
        # 40-step run spent ~3x longer per step with torch's default thread count).
        torch.set_num_threads(1)
        self.run_dir, self.env, self.seed = run_dir, env, seed
        self.temperature, self.max_new_tokens, self.load_timeout_s = temperature, max_new_tokens, load_timeout_s
        self.sampler = EmbeddedSampler()
        self._loaded = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._pinned: EmbeddedSampler | None = None  # the version the current eval is pinned to
        self._pinned_lock = asyncio.Lock()
        # Sampling threads mostly wait for the coalescing leader; their own pool keeps them from
        # starving weight reloads (which use the loop's default executor).
        self._pool = ThreadPoolExecutor(max_workers=SAMPLING_THREADS, thread_name_prefix="orch-sampler")

    async def load(self, version: int, health_check: Callable[[], None] | None = None) -> None:
        """Make `version` current (waits, bounded, for its STABLE marker; `health_check` raises
        if the trainer that should publish it has died)."""
        from orchestrator.rundir import is_stable, weights_dir

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

    def close(self) -> None:
        """Stop the sampling threads (a running forward pass finishes; nothing new starts)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _sampler_at(self, version: int):
        """The policy at exactly `version`, for an eval episode: a sampler of its own, loaded from
        `weights/step_{version}` and kept for the eval's next samples (the train sampler moves on
        to newer versions meanwhile). A version whose weights the trainer already pruned fails
        the episode."""
        from orchestrator.embedded.policy import EmbeddedSampler
        from orchestrator.rundir import weights_dir

        async with self._pinned_lock:
            if self._pinned is None or self._pinned.version != version:
                self._pinned = await asyncio.to_thread(EmbeddedSampler.from_weights, weights_dir(self.run_dir, version),
                                                       version)
            return self._pinned

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        await asyncio.wait_for(self._loaded.wait(), self.load_timeout_s)
        task = await self.env.task(req.task_id)
        seed = (self.seed << 32) ^ (req.episode_id << 4) ^ req.attempt
        sampler = self.sampler if req.eval_id is None else await self._sampler_at(req.policy_version)
        temperature = self.temperature if req.temperature is None else req.temperature
        # Coalesced: concurrent episodes' requests are sampled in one batched forward pass.
        sample = functools.partial(sampler.sample_coalesced, task.prompt, 1, temperature=temperature,
                                   max_new_tokens=self.max_new_tokens, seed=seed)
        (completion,) = await asyncio.get_running_loop().run_in_executor(self._pool, sample)
        version = completion.policy_version
        return EpisodeCompleted(
            episode_id=req.episode_id, group_id=req.group_id, ok=True,
            reward=await self.env.score(task, completion.text), token_ids=completion.token_ids,
            mask=completion.mask, logprobs=completion.full_logprobs, policy_start=version,
            policy_end=version, temperature=temperature,
        )

"""The `fake` inference backend: the fake env's episodes, each made whole from its seed (settings:
`env.fake`), no model (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import hashlib
import struct
from array import array
from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np

from orchestrator.contracts import (
    BuildContext,
    InferenceComponent,
    RolloutEnv,
    RolloutRequest,
    RunPlan,
    TrainingSample,
    episode_of_samples,
)
from orchestrator.core.arrays import LOGPROB_CODE, TOKEN_ID_CODE, Tokens
from orchestrator.core.events import EpisodeCompleted
from orchestrator.envs.fake import FakeEnvConfig


class FakeEpisodesConfig(InferenceComponent):
    """The fake env's episode source (settings: `env.fake`)."""

    follows_weights: ClassVar[bool] = False

    def check(self, plan: RunPlan) -> None:
        if set(plan.envs) != {"fake"}:
            raise ValueError("inference.kind='fake' makes the fake env's episodes only")

    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv]) -> FakeEpisodes:
        section = ctx.env_sections["fake"]
        assert isinstance(section, FakeEnvConfig)
        return FakeEpisodes(section, ctx.seed, ctx.version_now)


class FakeEpisodeError(RuntimeError):
    pass


class FakeEpisodes:
    """Seeded synthetic episodes: tokens, rewards, errors and latency from a per-episode hash.

    Everything an episode draws comes from hashes of (seed, episode, attempt), so an episode's
    outcome does not depend on which other episodes ran (and it is cheap: no RNG to seed).
    `version_now` tells which policy version the (imaginary) sampler holds, so policy_start and
    policy_end are honest about weight updates that land during a slow episode.
    """

    follows_weights: ClassVar[bool] = False

    def __init__(self, config: FakeEnvConfig, seed: int, version_now: Callable[[], int]):
        self.config, self.seed, self.version_now = config, seed, version_now
        # Per episode only the draws differ: the masks (immutable bytes) are shared, and the
        # sampled logprobs are a slice of a fixed float32 pool at a drawn offset.
        self._masks = [bytes(config.prompt_tokens) + b"\x01" * n for n in range(config.max_tokens + 1)]
        self._prompt_logprobs = array(LOGPROB_CODE, bytes(4 * config.prompt_tokens))
        self._logprob_pool = array(LOGPROB_CODE, [-((i * 167) % 256) / 64 for i in range(256 + config.max_tokens)])

    def _token_ids(self, key: bytes, n_tokens: int) -> array:
        """The episode's token ids: a SHAKE-128 stream of its key, 4 bytes per token reduced
        modulo the vocabulary (one call, however long the episode)."""
        raw = hashlib.shake_128(key).digest(4 * n_tokens)
        ids = np.frombuffer(raw, dtype="<u4") % np.uint32(self.config.vocab_size)
        return array(TOKEN_ID_CODE, ids.astype(np.int32).tobytes())

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        cfg = self.config
        key = b"%d/%d/%d" % (self.seed, req.episode_id, req.attempt)
        # Block 0 of blake2b(seed, episode, attempt): the uniforms every draw of the episode uses.
        latency, error, empty, length, reward, logprob_offset = _UNIFORMS.unpack_from(
            hashlib.blake2b(key, digest_size=64).digest()
        )
        # The fake sampler holds any version: an eval episode is sampled by the one it is pinned to.
        pinned = req.eval_id is not None
        policy_start = req.policy_version if pinned else self.version_now()
        if cfg.latency_s > 0:
            jitter = 2 * latency / _U32 - 1
            await asyncio.sleep(max(0.0, cfg.latency_s + jitter * cfg.latency_jitter_s))
        if error / _U32 < cfg.error_rate:
            raise FakeEpisodeError(f"fake env: episode {req.episode_id} failed (error_rate={cfg.error_rate})")
        spread = cfg.max_tokens - cfg.min_tokens + 1
        n_sampled = 0 if empty / _U32 < cfg.empty_rate else cfg.min_tokens + int(length / _U32 * spread)
        # The task sets a difficulty shared by the group, so groups have reward spread.
        score = min(1.0, max(0.0, (req.task_id % 7) / 7 + reward / _U32 * 0.5 - 0.25))
        policy_end = policy_start if pinned else self.version_now()
        if cfg.samples_per_episode > 1 and n_sampled:
            return self._several_samples(req, key, n_sampled, score, policy_start, policy_end)
        n_total = cfg.prompt_tokens + n_sampled
        offset = logprob_offset % 256
        return EpisodeCompleted(
            episode_id=req.episode_id,
            group_id=req.group_id,
            ok=True,
            temperature=1.0,
            reward=score,
            tokens=Tokens.of(
                self._token_ids(key, n_total),
                self._masks[n_sampled],
                self._prompt_logprobs + self._logprob_pool[offset : offset + n_sampled],
            ),
            policy_start=policy_start,
            policy_end=policy_end,
        )

    def _several_samples(
        self, req: RolloutRequest, key: bytes, n_sampled: int, reward: float, policy_start: int, policy_end: int
    ) -> EpisodeCompleted:
        """`samples_per_episode` samples, each its prompt and its own seeded completion (a length
        and logprob offset drawn from its own key), one after the other."""
        cfg = self.config
        samples = []
        for index in range(cfg.samples_per_episode):
            sample_key = key + b"/%d" % index
            length, offset = _TWO.unpack_from(hashlib.blake2b(sample_key, digest_size=8).digest())
            sampled = n_sampled if index == 0 else cfg.min_tokens + length % (cfg.max_tokens - cfg.min_tokens + 1)
            token_ids = self._token_ids(sample_key, cfg.prompt_tokens + sampled)
            logprobs = self._prompt_logprobs + self._logprob_pool[offset % 256 : offset % 256 + sampled]
            samples.append(TrainingSample(token_ids, self._masks[sampled], logprobs))
        return episode_of_samples(
            req, samples, reward=reward, policy_start=policy_start, policy_end=policy_end, temperature=1.0
        )

    async def load(self, version: int, health_check: Callable[[], None] | None = None) -> None:
        """Never called: it does not follow weights."""

    async def watch(self, report_endpoint_change: Callable[[str, bool, int, str], None]) -> None:
        """It launched no server: nothing to watch."""

    async def aclose(self) -> None:
        """It holds nothing."""


_TWO = struct.Struct("<2I")  # a sample's length and logprob offset
_UNIFORMS = struct.Struct("<6I")  # latency, error, empty, length, reward, logprob offset: over 2**32
_U32 = 4294967296.0

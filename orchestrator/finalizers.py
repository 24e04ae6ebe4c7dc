"""The algorithms' group finalizers: an async `finalize_group` (advantages of a closed group) and
the class flag that opts into background finalization (docs/rules.md, 3. Finalize); `algorithm.name`
picks one from `orchestrator.config.ALGORITHMS`.

Background-finalized algorithms run `finalize_group` concurrently for many groups, and results
come back in any order: a stateful algorithm must tolerate interleaved groups. The advantage
arithmetic itself is the core's (orchestrator.core.advantages), so inline and background agree.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import ClassVar, Protocol

from pydantic import Field

from orchestrator.contracts import AlgorithmComponent, BuildContext
from orchestrator.core.advantages import gar_advantages, grpo_advantages
from orchestrator.core.events import EpisodeCompleted


class GRPOConfig(AlgorithmComponent):
    """grpo: advantage = reward - group mean (inline), optionally divided by the group's std."""

    std_normalization: bool = Field(
        False, description="divide by the group's std + 1e-6 (off: Dr. GRPO, the centred rewards)"
    )

    def build(self, ctx: BuildContext) -> GRPO:
        return GRPO(self.std_normalization)


class GARConfig(AlgorithmComponent):
    """gar: the simulated slow grader's ranks blended with rewards (background); a real judge
    endpoint can replace the grader."""

    delay_s: float = Field(0.05, ge=0, description="mean grader latency")
    jitter_s: float = Field(0.02, ge=0, description="uniform +- jitter on the latency")
    failure_rate: float = Field(0.0, ge=0, le=1, description="probability a grader call raises")
    rank_noise: float = Field(0.1, ge=0, description="noise added to rewards before ranking")
    rank_weight: float = Field(0.5, ge=0, le=1, description="gar blend: weight of the grader rank")

    def build(self, ctx: BuildContext) -> GAR:
        return GAR(SimulatedGrader(self, ctx.seed), self.rank_weight)


class GRPO:
    name: ClassVar[str] = "grpo"
    finalize_in_background: ClassVar[bool] = False

    def __init__(self, std_normalization: bool = False):
        self.std_normalization = std_normalization

    async def finalize_group(self, group_id: int, traces: Sequence[EpisodeCompleted]) -> list[float]:
        return grpo_advantages([t.reward for t in traces], self.std_normalization)


class Grader(Protocol):
    async def rank(self, group_id: int, traces: Sequence[EpisodeCompleted]) -> list[int]:
        """Rank of each trace in the group, 0 = best (a permutation of 0..n-1)."""
        ...


class GraderError(RuntimeError):
    pass


class SimulatedGrader:
    """A slow external judge, simulated: latency with jitter, a failure rate, noisy ranking.

    Seeded per group, so a group's ranks do not depend on which other groups are grading.
    """

    def __init__(self, config: GARConfig, seed: int):
        self.config, self.seed = config, seed

    async def rank(self, group_id: int, traces: Sequence[EpisodeCompleted]) -> list[int]:
        cfg = self.config
        rng = random.Random(f"grader/{self.seed}/{group_id}")
        await asyncio.sleep(max(0.0, cfg.delay_s + rng.uniform(-cfg.jitter_s, cfg.jitter_s)))
        if cfg.failure_rate and rng.random() < cfg.failure_rate:
            raise GraderError(f"grader failed on group {group_id} (failure_rate={cfg.failure_rate})")
        noisy = [t.reward + rng.gauss(0.0, cfg.rank_noise) for t in traces]
        order = sorted(range(len(traces)), key=lambda i: -noisy[i])
        ranks = [0] * len(traces)
        for rank, index in enumerate(order):
            ranks[index] = rank
        return ranks


class GAR:
    """Grader-ranked group advantage redistribution; see core.advantages.gar_advantages."""

    name: ClassVar[str] = "gar"
    finalize_in_background: ClassVar[bool] = True

    def __init__(self, grader: Grader, rank_weight: float):
        self.grader, self.rank_weight = grader, rank_weight

    async def finalize_group(self, group_id: int, traces: Sequence[EpisodeCompleted]) -> list[float]:
        ranks = await self.grader.rank(group_id, traces)
        return gar_advantages([t.reward for t in traces], ranks, self.rank_weight)

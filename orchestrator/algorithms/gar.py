"""gar (grader-ranked group advantage redistribution): a grader's ranks blended with the rewards.
It calls a grader (here a simulated slow judge), so it always finalizes in the background."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import ClassVar, Protocol

from pydantic import Field

from orchestrator.contracts import AlgorithmComponent, BuildContext, RunPlan
from orchestrator.core.advantages import grpo_advantages
from orchestrator.core.events import EpisodeCompleted


class GARConfig(AlgorithmComponent):
    """gar: the simulated slow grader's ranks blended with rewards (background); a real judge
    endpoint can replace the grader."""

    finalize_in_background: ClassVar[bool] = True

    delay_s: float = Field(0.05, ge=0, description="mean grader latency")
    jitter_s: float = Field(0.02, ge=0, description="uniform +- jitter on the latency")
    failure_rate: float = Field(0.0, ge=0, le=1, description="probability a grader call raises")
    rank_noise: float = Field(0.1, ge=0, description="noise added to rewards before ranking")
    rank_weight: float = Field(0.5, ge=0, le=1, description="gar blend: weight of the grader rank")

    def check(self, plan: RunPlan) -> None:
        if not plan.finalize_in_background:
            raise ValueError("algorithm 'gar' calls a grader and must finalize in the background")

    def build(self, ctx: BuildContext) -> GAR:
        return GAR(SimulatedGrader(self, ctx.seed), self.rank_weight)


def gar_advantages(rewards: Sequence[float], ranks: Sequence[int], rank_weight: float) -> list[float]:
    """GAR's advantages of a group from its rewards and the grader's ranks (0 = best).

    Each member's score blends its env reward with its rank turned into [0, 1] (best = 1, worst = 0):

        score_i = (1 - w) * reward_i + w * (1 - rank_i / (n - 1))      (rank term = 0.5 when n = 1)
        advantage_i = score_i - mean(score)

    so the advantages are zero-mean within the group; w = rank_weight in [0, 1].
    """
    n = len(rewards)
    if len(ranks) != n:
        raise ValueError(f"gar: {len(ranks)} ranks for a group of {n}")
    if sorted(ranks) != list(range(n)):
        raise ValueError(f"gar: ranks must be a permutation of 0..{n - 1}, got {list(ranks)}")
    rank_scores = [0.5] * n if n == 1 else [1.0 - rank / (n - 1) for rank in ranks]
    scores = [(1.0 - rank_weight) * r + rank_weight * s for r, s in zip(rewards, rank_scores)]
    return grpo_advantages(scores)


class Grader(Protocol):
    async def rank(self, group_id: int, episodes: Sequence[EpisodeCompleted]) -> list[int]:
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

    async def rank(self, group_id: int, episodes: Sequence[EpisodeCompleted]) -> list[int]:
        cfg = self.config
        rng = random.Random(f"grader/{self.seed}/{group_id}")
        await asyncio.sleep(max(0.0, cfg.delay_s + rng.uniform(-cfg.jitter_s, cfg.jitter_s)))
        if cfg.failure_rate and rng.random() < cfg.failure_rate:
            raise GraderError(f"grader failed on group {group_id} (failure_rate={cfg.failure_rate})")
        noisy = [t.reward + rng.gauss(0.0, cfg.rank_noise) for t in episodes]
        order = sorted(range(len(episodes)), key=lambda i: -noisy[i])
        ranks = [0] * len(episodes)
        for rank, index in enumerate(order):
            ranks[index] = rank
        return ranks


class GAR:
    """Grader-ranked group advantage redistribution: `gar_advantages` of the grader's ranks."""

    def __init__(self, grader: Grader, rank_weight: float):
        self.grader, self.rank_weight = grader, rank_weight

    async def finalize_group(self, group_id: int, episodes: Sequence[EpisodeCompleted]) -> list[float]:
        ranks = await self.grader.rank(group_id, episodes)
        return gar_advantages([t.reward for t in episodes], ranks, self.rank_weight)

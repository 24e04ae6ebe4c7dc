"""Pure advantage rules. The shell's algorithm classes call these, so inline and background
finalization compute exactly the same numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Added to the group's std before dividing by it: a group of equal rewards has advantages 0.
STD_EPSILON = 1e-6


def grpo_advantages(rewards: Sequence[float], std_normalization: bool = False) -> list[float]:
    """GRPO: advantage = reward - group mean; with `std_normalization`, divided by the group's
    (population) std + STD_EPSILON. Off (Dr. GRPO): the centred rewards alone."""
    mean = sum(rewards) / len(rewards)
    centred = [reward - mean for reward in rewards]
    if not std_normalization:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + STD_EPSILON) for c in centred]


def gar_advantages(rewards: Sequence[float], ranks: Sequence[int], rank_weight: float) -> list[float]:
    """GAR (grader-ranked group advantage redistribution).

    The grader ranks the group's members (0 = best). Each member's score blends its env reward
    with its rank turned into [0, 1] (best = 1, worst = 0):

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


# Algorithms whose scoring the core can run inline, by name: (rewards, std_normalization) ->
# advantages. An algorithm missing here needs the shell (an external grader) and must finalize in
# the background (as must every algorithm of a plugin).
INLINE_SCORERS = {"grpo": grpo_advantages}
BACKGROUND_ONLY = frozenset({"gar"})

"""Pure advantage rules: the scorers the core runs inline, by the algorithm name a log's
`run_started` carries, so a log is re-scored from its own params. An algorithm's module
(orchestrator/algorithms) finalizes in the background with the same function, so inline and
background finalization compute exactly the same numbers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

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


def _grpo(rewards: Sequence[float], params: Any) -> list[float]:
    return grpo_advantages(rewards, params.std_normalization)


# An inline scorer: (a pool's rewards, the run's CoreParams) -> advantages; it reads its own
# algorithm's settings from the params (`AlgorithmComponent.core_settings` put them there).
# (`Any`: CoreParams is declared in `events`, which imports this module.)
InlineScorer = Callable[[Sequence[float], Any], list[float]]

# The algorithms the core scores inline, by name. Every other one (a grader's, a plugin's)
# finalizes in the background, its results logged.
INLINE_SCORERS: dict[str, InlineScorer] = {"grpo": _grpo}

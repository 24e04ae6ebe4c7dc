"""grpo: advantage = reward - group mean, optionally divided by the group's std; scored inline by
the core (`orchestrator.core.advantages.grpo_advantages`) unless `algorithm.finalize_in_background`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field

from orchestrator.contracts import AlgorithmComponent, BuildContext
from orchestrator.core.advantages import grpo_advantages
from orchestrator.core.events import EpisodeCompleted


class GRPOConfig(AlgorithmComponent):
    """grpo: advantage = reward - group mean (inline), optionally divided by the group's std."""

    finalize_in_background: ClassVar[bool] = False

    std_normalization: bool = Field(
        False, description="divide by the group's std + 1e-6 (off: Dr. GRPO, the centred rewards)"
    )

    def core_settings(self) -> dict[str, Any]:
        return {"std_normalization": self.std_normalization}

    def build(self, ctx: BuildContext) -> GRPO:
        return GRPO(self.std_normalization)


class GRPO:
    def __init__(self, std_normalization: bool = False):
        self.std_normalization = std_normalization

    async def finalize_group(self, group_id: int, episodes: Sequence[EpisodeCompleted]) -> list[float]:
        return grpo_advantages([t.reward for t in episodes], self.std_normalization)

"""The `fake` env: seeded synthetic episodes, no model (tests and benchmarks). Its episodes come
whole from the `fake` inference backend (`orchestrator.inference.fake`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import ClassVar

from pydantic import Field, model_validator

from orchestrator.contracts import (
    BuildContext,
    EnvComponent,
    RolloutEnv,
    RunPlan,
)


class FakeEnvConfig(EnvComponent):
    """The `fake` env: seeded synthetic episodes, no model (tests and benchmarks)."""

    synthetic: ClassVar[bool] = True

    latency_s: float = Field(0.0, ge=0, description="mean episode latency (0 = instant)")
    latency_jitter_s: float = Field(0.0, ge=0, description="uniform +- jitter on the latency")
    error_rate: float = Field(0.0, ge=0, le=1, description="probability an episode raises")
    empty_rate: float = Field(0.0, ge=0, le=1, description="probability an episode samples no token")
    prompt_tokens: int = Field(8, ge=0, description="prompt length of every fake episode, in tokens")
    min_tokens: int = Field(4, ge=1, description="shortest completion, in sampled tokens")
    max_tokens: int = Field(16, ge=1, description="longest completion, in sampled tokens")
    samples_per_episode: int = Field(
        1,
        ge=1,
        le=64,
        description="training samples per episode, each with its own seeded arrays (docs/rules.md, Samples)",
    )
    vocab_size: int = Field(
        151_936,
        ge=1,
        le=2**31,
        description="token ids are drawn from [0, vocab_size) (the default: a Qwen-size vocabulary)",
    )

    @model_validator(mode="after")
    def _range(self) -> FakeEnvConfig:
        if self.min_tokens > self.max_tokens:
            raise ValueError("env.fake.min_tokens must be <= env.fake.max_tokens")
        return self

    def check(self, plan: RunPlan) -> None:
        if plan.inference != "fake":
            raise ValueError(f"the fake env's episodes come whole from inference.kind='fake', not {plan.inference!r}")

    @asynccontextmanager
    async def open(self, ctx: BuildContext) -> AsyncIterator[RolloutEnv | None]:
        yield None  # no task source: the fake backend makes each episode whole

"""`env.verifiers`: a verifiers (v1) taskset as an orch env: the section (its settings,
:mod:`.config`), what it supports, and its factory (:mod:`.env`, imported only in `open`)."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

from orchestrator.contracts import BuildContext, ConfigError, EnvComponent, RunPlan
from orchestrator.verifiers.config import VerifiersSettings, check_env

if TYPE_CHECKING:
    from orchestrator.verifiers.env import VerifiersEnv


class VerifiersConfig(EnvComponent, VerifiersSettings):
    """A verifiers (v1) taskset, its model calls through inference.openai (vLLM with --enable-scale-out)."""

    gives_messages: ClassVar[bool] = True  # rendered client-side with the model's chat template

    resumable: ClassVar[frozenset[str]] = frozenset(
        {"path", "rollout_timeout_s", "setup_timeout_s", "scoring_timeout_s"}
    )

    def check(self, plan: RunPlan) -> None:
        """ValueError (one line) unless the taskset can run in this run: alone, sampled by the
        `openai` backend, evals only with held-out tasks, verifiers installed (the taskset
        itself and its held-out tasks: `preflight`)."""
        if set(plan.envs) != {"verifiers"}:
            raise ValueError("env 'verifiers' runs alone (its episodes come whole from verifiers)")
        if plan.inference != "openai":
            raise ValueError(
                "env 'verifiers' samples through inference.kind='openai' (vLLM started with --enable-scale-out), "
                f"not {plan.inference!r}"
            )
        if plan.eval_envs and not self.held_out:
            raise ValueError(
                "evals of env 'verifiers' draw from env.verifiers.held_out (a task match, e.g. {idx = [\"0:64\"]}), "
                "which is empty: a verifiers taskset has no split of its own"
            )
        if self.taskset is None:
            raise ValueError("env 'verifiers' needs env.verifiers.taskset (an importable taskset module)")
        if importlib.util.find_spec("verifiers") is None:
            raise ValueError("env 'verifiers' needs the verifiers package: pip install 'orch[verifiers]'")

    def solved(self, reward: float) -> bool | None:
        return None if self.success_threshold is None else reward >= self.success_threshold

    def preflight(self, seed: int) -> None:
        """The taskset module found, and its env with a trainable agent (what orch trains on):
        verifiers loads it and runs its setup, so not while the config is validated."""
        try:
            check_env(self.model_dump_json())
        except ValueError as err:
            raise ConfigError(f"invalid config: {err}") from None

    @asynccontextmanager
    async def open(self, ctx: BuildContext) -> AsyncIterator[VerifiersEnv]:
        """The taskset's env with verifiers' serving resources (its interception server) up for
        the run; at its end, the run's episode figures (`VerifiersEnv.report`)."""
        from orchestrator.notices import report
        from orchestrator.verifiers.env import VerifiersEnv  # verifiers: only now

        if ctx.model is None:
            raise ValueError("env 'verifiers' renders its prompts with the run's prepared model (the hf trainer's)")
        model_dir = str(ctx.model.path.resolve())
        env = VerifiersEnv(
            self,
            seed=ctx.seed,
            temperature=ctx.sampling.temperature,
            max_tokens=ctx.sampling.max_new_tokens,
            model=ctx.served_model or model_dir,  # the name vLLM serves it under
            renderer_model=model_dir,
        )
        try:
            async with env.serving():
                yield env
        finally:
            report(env.report())

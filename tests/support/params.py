"""Core parameters for simulated runs, and a driver of the pure core by hand, one input at a time."""

from __future__ import annotations

from typing import Any

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.decide import decide
from orchestrator.core.state import initial_state


def sim_params(seed: int = 0, **overrides: Any) -> ev.CoreParams:
    """A small two-env run (10 steps of 16 traces, groups of 4) that the zero-output guard never stops."""
    base: dict[str, Any] = {
        "seed": seed,
        "env_ratios": {"a": 1.0, "b": 1.5},
        "group_size": 4,
        "batch_size": 16,
        "max_inflight": 24,
        "max_steps": 10,
        "max_off_policy_steps": 2,
        "zero_output_batches": 1000,
    }
    return ev.CoreParams(**{**base, **overrides})


def eval_params(**overrides: Any) -> ev.EvalParams:
    """Evals of env `a` every 2 steps: 3 tasks, 2 samples each, 4 in flight."""
    base: dict[str, Any] = {"envs": ["a"], "every": 2, "num_tasks": 3, "samples_per_task": 2, "max_inflight": 4}
    return ev.EvalParams(**{**base, **overrides})


def eval_sim_params(seed: int = 0, **overrides: Any) -> ev.CoreParams:
    """`sim_params` with evals (`eval_params`), two equal envs and 6 steps of 8 traces."""
    base: dict[str, Any] = {
        "env_ratios": {"a": 1.0, "b": 1.0},
        "batch_size": 8,
        "max_inflight": 16,
        "max_steps": 6,
        "eval": eval_params(),
    }
    return sim_params(seed, **{**base, **overrides})


def trainer_bound_params(seed: int, **overrides: Any) -> ev.CoreParams:
    """One env, 25 steps of 64 traces and slack for 8 batches in flight: with a trainer slower than
    the env, most of what the sampler generates would go stale without the dispatch capacity."""
    base: dict[str, Any] = {
        "seed": seed,
        "env_ratios": {"a": 1.0},
        "group_size": 8,
        "batch_size": 64,
        "max_inflight": 512,
        "max_off_policy_steps": 2,
        "target_lag": 1,
        "max_steps": 25,
        "zero_output_batches": 1000,
    }
    return ev.CoreParams(**{**base, **overrides})


class Driver:
    """The pure core fed by hand: each input decided, and logged with its decisions."""

    def __init__(self, **params: Any) -> None:
        params.setdefault("env_ratios", {"a": 1.0})
        self.params = ev.CoreParams(**params)
        self.state = initial_state(self.params)
        self.log: list = []

    def feed(self, event) -> list:
        out = decide(self.state, event)
        self.log.append(event)
        self.log.extend(out)
        return out

    def start(self) -> list:
        return self.feed(ev.RunStarted(params=self.params))

    def complete(
        self,
        episode_id: int,
        *,
        reward: float = 0.5,
        ok: bool = True,
        sampled: int = 2,
        policy_start: int | None = None,
        prompt: int = 1,
    ) -> list:
        group_id = self.state.inflight[episode_id]
        start = self.state.version if policy_start is None else policy_start
        n = prompt + sampled
        return self.feed(
            ev.EpisodeCompleted(
                episode_id=episode_id,
                group_id=group_id,
                ok=ok,
                temperature=1.0,
                reward=reward if ok else 0.0,
                tokens=Tokens.of([7] * n, [0] * prompt + [1] * sampled, [0.0] * n) if ok else None,
                policy_start=start,
                policy_end=self.state.version,
                error=None if ok else "boom",
            )
        )

    def complete_group(self, group_id: int, rewards, **kw) -> list:
        out = []
        members = [e for e, g in self.state.inflight.items() if g == group_id]
        assert len(members) >= len(rewards), f"group {group_id} has {len(members)} in flight"
        for episode_id, reward in zip(members, rewards):
            out += self.complete(episode_id, reward=reward, **kw)
        return out

    def publish(self, version: int) -> list:
        return self.feed(ev.VersionPublished(version=version))

    def kinds(self, events) -> list[str]:
        return [e.kind for e in events]

    def of(self, events, kind: str) -> list:
        return [e for e in events if e.kind == kind]

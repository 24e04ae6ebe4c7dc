"""Helpers to drive the pure core by hand, one input at a time."""

from __future__ import annotations

import pytest

from orchestrator.core import events as ev
from orchestrator.core.decide import decide
from orchestrator.core.state import initial_state


class Driver:
    def __init__(self, **params):
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

    def complete(self, episode_id: int, *, reward: float = 0.5, ok: bool = True, sampled: int = 2,
                 policy_start: int | None = None, prompt: int = 1) -> list:
        group_id = self.state.inflight[episode_id]
        start = self.state.version if policy_start is None else policy_start
        n = prompt + sampled
        return self.feed(ev.EpisodeCompleted(
            episode_id=episode_id, group_id=group_id, ok=ok, reward=reward if ok else 0.0,
            token_ids=[7] * n if ok else [], mask=([0] * prompt + [1] * sampled) if ok else [],
            logprobs=[0.0] * n if ok else [], policy_start=start, policy_end=self.state.version,
            error=None if ok else "boom",
        ))

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


@pytest.fixture
def driver():
    return Driver

"""What an environment is to orch: a deterministic task source and a scorer.

An env never samples from the policy itself; the rollout worker asks the policy for a completion
of ``task.prompt`` and hands the text back to :meth:`TextEnv.score`. Tasks are a pure function of
``(seed, index)`` so a resumed or re-executed run sees exactly the same tasks.

Rollout workers reach an env through the async :class:`RolloutEnv`: :class:`InProcessEnv` for an
env in this process, or ``orchestrator.envs.client.HttpEnvClient`` for one behind
``orch env-server`` (``rollout.env_server``). An env whose episodes are agent runs (verifiers
tasksets) is an :class:`AgentEnv` instead: it samples through the backend's client itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from orchestrator.components import RolloutRequest
    from orchestrator.core.events import EpisodeCompleted
    from orchestrator.inference.client import InferenceClient


@dataclass(frozen=True)
class Task:
    env: str
    index: int
    prompt: str
    answer: str
    # The prompt as chat messages ({"role", "content"}), rendered with the model's chat template;
    # None: the prompt is plain text, sent as its tokens.
    messages: list[dict[str, str]] | None = None


class TextEnv(Protocol):
    name: str

    def task(self, index: int) -> Task:
        """The task at cursor position ``index`` (deterministic)."""
        ...

    def score(self, task: Task, completion: str) -> float:
        """Reward in [0, 1] for ``completion`` as an answer to ``task``."""
        ...


class RolloutEnv(Protocol):
    """A `TextEnv` as the rollout workers call it: awaited, so it may live in another process."""

    async def task(self, index: int) -> Task: ...

    async def score(self, task: Task, completion: str) -> float: ...


class InProcessEnv:
    """A `TextEnv` of this process behind the `RolloutEnv` interface."""

    def __init__(self, env: TextEnv) -> None:
        self.env = env

    async def task(self, index: int) -> Task:
        return self.env.task(index)

    async def score(self, task: Task, completion: str) -> float:
        return self.env.score(task, completion)


@runtime_checkable
class AgentEnv(Protocol):
    """An env that plays each episode itself (an agent run: several model calls, multi-turn), its
    model calls through the sampler's inference client (the `openai` backend hands it over); it
    returns the episode's one sample (raising: a failed episode)."""

    async def episode(self, request: RolloutRequest, client: InferenceClient, /) -> EpisodeCompleted: ...

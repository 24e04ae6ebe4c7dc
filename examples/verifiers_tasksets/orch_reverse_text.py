"""reverse_text as a verifiers (v1) taskset: reverse a short random string, answer inside
<reversed_text>...</reversed_text>; one turn. The tasks and the reward are orch's reverse_text env's
(orchestrator/envs/reverse_text.py), so the tiny model learns the same thing either way."""

from __future__ import annotations

import verifiers.v1 as vf
from pydantic import Field

from orchestrator.envs.reverse_text import ReverseTextEnv, reversal_reward


class ReverseTextTasksetConfig(vf.TasksetConfig):
    size: int = Field(256, ge=1)
    """Tasks in the taskset (orch draws from them with the run's seed)."""
    seed: int = 0
    """Seeds the strings (reverse_text's task seed)."""
    min_len: int = Field(3, ge=1)
    max_len: int = Field(6, ge=1)


class ReverseTextData(vf.TaskData):
    text: str
    """The string to reverse (also the prompt: the tiny model was warm-started on bare strings)."""


class ReverseTextTask(vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversal(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return reversal_reward(trace.last_reply, task.text)


def reverse_text_tasks(cfg: ReverseTextTasksetConfig):
    source = ReverseTextEnv(seed=cfg.seed, min_len=cfg.min_len, max_len=cfg.max_len)
    for index in range(cfg.size):
        text = source.task(index).prompt
        yield ReverseTextTask(ReverseTextData(prompt=text, text=text, name=f"reverse_text#{index}"), cfg.task)


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextTasksetConfig]):
    def load(self):
        return reverse_text_tasks(self.config)


__all__ = ["ReverseTextTaskset"]

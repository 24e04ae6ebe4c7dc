"""reverse_text played by two trainable agents at once (seats `alice` and `bob`), each answer
scored by the task's own reward: an episode of two traces, each trained as its own sample and
scored against the same agent across the group. Same tasks as the example orch_reverse_text."""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf
from orch_reverse_text import ReverseTextTask, ReverseTextTasksetConfig, reverse_text_tasks


class TwoAgentsTaskset(vf.Taskset[ReverseTextTask, ReverseTextTasksetConfig]):
    def load(self):
        return reverse_text_tasks(self.config)


class TwoAgentsConfig(vf.EnvConfig):
    alice: vf.AgentConfig = vf.AgentConfig()
    bob: vf.AgentConfig = vf.AgentConfig()


class TwoAgentsEnv(vf.Env[TwoAgentsConfig]):
    async def run(self, task, agents) -> None:
        async with asyncio.TaskGroup() as tg:  # a failing agent cancels the other
            tg.create_task(agents.alice.run(task))
            tg.create_task(agents.bob.run(task))


__all__ = ["TwoAgentsTaskset", "TwoAgentsEnv"]

"""reverse_text in two turns: the model answers, the env (playing the user) sends feedback, the
model answers again. The reward is the second answer's (the taskset's `reversal`, scored when the
exchange closes); the first answer's is kept in the trace's info. Same tasks as orch_reverse_text.

The feedback is `feedback.format(score=..., text=...)`. The default is the bare string again: the
tiny model was warm-started on bare strings only, so that is what it can answer; a real model
would be told e.g. "your answer scored {score:.2f}; reverse {text} again"."""

from __future__ import annotations

import verifiers.v1 as vf
from orch_reverse_text import ReverseTextTask, ReverseTextTasksetConfig, reverse_text_tasks

from orchestrator.envs.reverse_text import reversal_reward


class TwoTurnTasksetConfig(ReverseTextTasksetConfig):
    feedback: str = "{text}"
    """The env's second user turn; {score} is the first answer's reward, {text} the string."""


class ReverseTextTwoTurnTaskset(vf.Taskset[ReverseTextTask, TwoTurnTasksetConfig]):
    def load(self):
        return reverse_text_tasks(self.config)


class TwoTurnEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class ReverseTextTwoTurnEnv(vf.Env[TwoTurnEnvConfig]):
    async def run(self, task, agents) -> None:
        text = task.data.text
        async with agents.agent.interaction(task) as interaction:
            first = await interaction.turn()
            score = reversal_reward(first.last_reply, text)
            await interaction.turn(self.taskset.config.feedback.format(score=score, text=text))
        interaction.trace.info["first_reward"] = score


__all__ = ["ReverseTextTwoTurnTaskset", "ReverseTextTwoTurnEnv"]

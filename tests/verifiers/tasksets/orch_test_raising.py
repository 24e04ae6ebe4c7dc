"""reverse_text whose reward raises on the tasks of odd index: those episodes fail, the run goes on."""

import verifiers.v1 as vf

from orchestrator.envs.reverse_text import reversal_reward


class Data(vf.TaskData):
    text: str


class RaisingTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversal(self, task: Data, trace: vf.Trace) -> float:
        if task.idx % 2:
            raise RuntimeError(f"reward of task {task.idx} raised on purpose")
        return reversal_reward(trace.last_reply, task.text)


class RaisingTaskset(vf.Taskset[RaisingTask, vf.TasksetConfig]):
    def load(self):
        for text in ("abc", "dcab", "hgf", "efgh", "bad", "cafe"):
            yield RaisingTask(Data(prompt=text, text=text), self.config.task)


__all__ = ["RaisingTaskset"]

"""A taskset whose env trains nothing: its one seat is marked untrainable (a judge-only env)."""

import verifiers.v1 as vf


class Task(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    pass


class UntrainableTaskset(vf.Taskset[Task, vf.TasksetConfig]):
    def load(self):
        yield Task(vf.TaskData(prompt="abc"), self.config.task)


class JudgeOnlyConfig(vf.EnvConfig):
    judge: vf.AgentConfig = vf.AgentConfig()


class JudgeOnlyEnv(vf.Env[JudgeOnlyConfig]):
    async def setup(self, agents) -> None:
        agents.judge.trainable = False

    async def run(self, task, agents) -> None:
        await agents.judge.run(task)


__all__ = ["UntrainableTaskset", "JudgeOnlyEnv"]

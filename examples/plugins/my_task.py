"""A text env of your own package (docs/plugins.md): write a short word in capitals.

`orch run --env my_task:UppercaseConfig` with this file's directory on PYTHONPATH, or installed
(pip install examples/plugins) as the entry point `uppercase` of the group `orch.envs`."""

import difflib
import random

from pydantic import Field

from orchestrator.contracts import Task, TextEnvComponent


class UppercaseEnv:
    name = "uppercase"

    def __init__(self, seed: int, length: int):
        self.seed, self.length = seed, length

    def task(self, index: int) -> Task:
        # A pure function of (seed, index); index < 0 is a held-out task (its own RNG stream).
        rng = random.Random(f"uppercase/{self.seed}/{index}")
        word = "".join(rng.choice("abcdefgh") for _ in range(self.length))
        return Task(env=self.name, index=index, prompt=word, answer=word.upper())

    def score(self, task: Task, completion: str) -> float:
        return difflib.SequenceMatcher(None, completion.strip(), task.answer).ratio()


class UppercaseConfig(TextEnvComponent):
    """uppercase: write a short word in capitals."""

    length: int = Field(4, ge=1, description="letters per word")

    def text_env(self, seed: int) -> UppercaseEnv:
        return UppercaseEnv(seed, self.length)

    def solved(self, reward: float) -> bool:
        return reward == 1.0

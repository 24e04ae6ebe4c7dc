"""reasoning_gym: reasoning-gym's procedural data sets as an env (docs/reasoning_gym.md).

Each data set is reasoning-gym's own: `reasoning_gym.create_dataset(name, seed=seed, size=size,
**config)`, an item a pure function of (seed, item index); the reward is the data set's own
`score_answer(answer, item)` on the answer extracted from the completion.

Task `index >= 0` (train) picks a data set by its weight, as a pure function of (seed, index), and
that data set's item `index % train_size`; held-out task `index < 0` picks one the same way and
its item `train_size + (-index - 1) % held_out_size`. The two index ranges do not meet, and a
train item whose question is a held-out question of its data set (a small task space repeats
itself) is replaced by the next train item that is not: train and held-out never share a question.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any, Literal

from pydantic import Field

from orchestrator.contracts import ConfigError, RunPlan, Task, TextEnvComponent
from orchestrator.notices import one_line

NAME = "reasoning_gym"
EXTRA = "pip install 'orch[reasoning-gym]'"
DEFAULT_SYSTEM_PROMPT = "default"  # the key of reasoning-gym's SYSTEM_PROMPTS that asks for <answer> tags


def _library() -> Any:
    """The `reasoning_gym` module, or ConfigError (one line) naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"env reasoning_gym needs the reasoning-gym package: {EXTRA}") from None
    return reasoning_gym


def extract_answer(completion: str, extract: str, tag: str, regex: str | None) -> str | None:
    """The answer in `completion`: the text of the last <tag>...</tag> (`tag`), the last match of
    `regex` (its first group if it has one: `regex`), or the whole completion stripped
    (`completion`); None if there is none."""
    if extract == "completion":
        return completion.strip()
    pattern = regex if extract == "regex" else rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>"
    assert pattern is not None  # check() refused extract = "regex" without a regex
    matches = list(re.finditer(pattern, completion, flags=re.DOTALL))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


class ReasoningGymEnv:
    """The `TextEnv` of one or several reasoning-gym data sets."""

    name = NAME

    def __init__(self, section: ReasoningGymConfig, seed: int):
        self.section, self.seed = section, seed
        self.names = list(section.datasets)
        self.weights = [section.datasets[name] for name in self.names]

    @functools.cached_property
    def datasets(self) -> dict[str, Any]:
        """Each data set, built on first use (ConfigError, one line, if one does not build)."""
        library, size = _library(), self.section.train_size + self.section.held_out_size
        built = {}
        for name in self.names:
            try:
                built[name] = library.create_dataset(
                    name, seed=self.seed, size=size, **self.section.config.get(name, {})
                )
            except Exception as err:  # noqa: BLE001 - reasoning-gym's refusal of a name or a config, alike
                message = one_line(err) or type(err).__name__
                raise ConfigError(f"env.reasoning_gym: data set {name!r} does not build: {message}") from None
        return built

    @functools.cached_property
    def held_out_questions(self) -> dict[str, set[str]]:
        """Each data set's held-out questions, which no train task asks."""
        first, count = self.section.train_size, self.section.held_out_size
        return {name: {dataset[first + j]["question"] for j in range(count)} for name, dataset in self.datasets.items()}

    @functools.cached_property
    def system_prompt(self) -> str | None:
        prompt = self.section.system_prompt
        if prompt == DEFAULT_SYSTEM_PROMPT:
            _library()
            from reasoning_gym.utils import SYSTEM_PROMPTS

            return str(SYSTEM_PROMPTS[DEFAULT_SYSTEM_PROMPT])
        return prompt or None

    def source(self, index: int) -> tuple[str, int]:
        """The data set and item index of task `index` (a pure function of seed and index)."""
        return self._entry(index)[:2]

    def _entry(self, index: int) -> tuple[str, int, dict[str, Any]]:
        """The data set, item index and item of task `index`: reasoning-gym generates an item anew on
        each lookup, so the train item compared with the held-out questions is the one returned."""
        rng = random.Random(f"{NAME}/{self.seed}/{index}")
        name = rng.choices(self.names, weights=self.weights)[0] if len(self.names) > 1 else self.names[0]
        train_size, held_out_size = self.section.train_size, self.section.held_out_size
        dataset = self.datasets[name]
        if index < 0:
            item_index = train_size + (-index - 1) % held_out_size
            return name, item_index, dataset[item_index]
        held = self.held_out_questions[name]
        for step in range(train_size):
            item_index = (index + step) % train_size
            item = dataset[item_index]
            if item["question"] not in held:
                return name, item_index, item
        raise ValueError(f"reasoning_gym: every train item of {name!r} is a held-out question; raise train_size")

    def task(self, index: int) -> Task:
        item = self._entry(index)[2]
        question = str(item["question"])
        messages = [{"role": "user", "content": question}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Task(env=self.name, index=index, prompt=question, answer=str(item["answer"]), messages=messages)

    def score(self, task: Task, completion: str) -> float:
        name, _, item = self._entry(task.index)
        section = self.section
        answer = extract_answer(completion, section.extract, section.tag, section.regex)
        return float(self.datasets[name].score_answer(answer, item))


class ReasoningGymConfig(TextEnvComponent):
    """reasoning_gym: reasoning-gym's procedural data sets, scored by their own score_answer
    (docs/reasoning_gym.md)."""

    gives_messages = True
    datasets: dict[str, float] = Field(
        default_factory=lambda: {"leg_counting": 1.0},
        description="reasoning-gym data sets by name, each with its weight among the tasks",
    )
    config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="a data set's config by its name, e.g. {basic_arithmetic = {min_terms = 2}}",
    )
    seed: int | None = Field(None, description="the data sets' seed; None: the run's seed")
    train_size: int = Field(
        100_000, gt=0, description="train tasks come from items 0 .. train_size - 1 of each data set"
    )
    held_out_size: int = Field(
        200, gt=0, description="held-out tasks (evals) from items train_size .. train_size + held_out_size - 1"
    )
    extract: Literal["tag", "regex", "completion"] = Field(
        "tag", description="the answer: the last <tag>...</tag>, the last match of regex, or the whole completion"
    )
    tag: str = Field("answer", description="extract = 'tag': the tag around the answer")
    regex: str | None = Field(None, description="extract = 'regex': its last match (its first group, if any)")
    system_prompt: str | None = Field(
        DEFAULT_SYSTEM_PROMPT,
        description="'default': reasoning-gym's (asks for <answer> tags); other text: yours; None or '': none",
    )
    success_threshold: float = Field(1.0, description="a reward at or above it solves the task (pass@k)")

    def check(self, plan: RunPlan) -> None:
        if not self.datasets:
            raise ValueError("env.reasoning_gym.datasets is empty: name at least one data set")
        bad = [name for name, weight in self.datasets.items() if not weight > 0]
        if bad:
            raise ValueError(f"env.reasoning_gym.datasets: the weight of {', '.join(bad)} is not positive")
        unused = sorted(set(self.config) - set(self.datasets))
        if unused:
            raise ValueError(f"env.reasoning_gym.config names {', '.join(unused)}, which datasets does not")
        if self.extract == "regex":
            if not self.regex:
                raise ValueError("env.reasoning_gym.extract = 'regex' needs env.reasoning_gym.regex")
            try:
                re.compile(self.regex)
            except re.error as err:
                raise ValueError(f"env.reasoning_gym.regex {self.regex!r} is not a regex: {err}") from None

    def solved(self, reward: float) -> bool:
        return reward >= self.success_threshold

    def preflight(self, seed: int) -> None:
        """The package imported and every data set built (a name reasoning-gym lacks is one line)."""
        _library()
        from reasoning_gym.factory import DATASETS

        unknown = [name for name in self.datasets if name not in DATASETS]
        if unknown:
            raise ConfigError(
                f"env.reasoning_gym: no data set {', '.join(map(repr, unknown))} in reasoning-gym "
                f"(it has {len(DATASETS)}: {', '.join(sorted(DATASETS))})"
            )
        self.text_env(seed).task(0)  # builds every data set and the held-out questions

    def text_env(self, seed: int) -> ReasoningGymEnv:
        return ReasoningGymEnv(self, seed if self.seed is None else self.seed)

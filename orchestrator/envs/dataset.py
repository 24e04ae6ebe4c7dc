"""dataset: tasks from a local data file, rewards from reward functions of TRL's signature
(docs/dataset.md).

Rows come from a JSONL, CSV or Parquet file, or a Hugging Face `datasets` data set saved to disk
(`save_to_disk`): a `prompt` column (a string: sent as its tokens; a list of chat messages:
rendered with the model's chat template) or a `messages` column (chat messages); every other
column is passed to the reward functions. Train task `index >= 0` is a row of the train rows, in
an order a pure function of (seed, pass over the rows); held-out task `index < 0` is a row of the
held-out rows (a file of its own, or the train file's rows whose stable hash falls under
`held_out_fraction`, which are then never trained on).

A reward function is called as TRL calls it, on one completion at a time:
`f(prompts=[prompt], completions=[completion], completion_ids=[None], **{column: [value]})`, and
returns `[float | None]`. The reward is the weighted sum of the numbers returned; a None says the
function does not apply to that sample and is left out of the sum (all None: reward 0.0, as TRL's
nansum gives). Anything else (not a list of one, a non-finite number) fails the episode.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from pydantic import Field, field_validator

from orchestrator.contracts import ConfigError, RunPlan, Section, Task, TextEnvComponent
from orchestrator.envs.draw import task_index
from orchestrator.notices import one_line
from orchestrator.plugins import PluginError, import_attribute

NAME = "dataset"
PROMPT_COLUMNS = ("prompt", "messages")
ANSWER_COLUMNS = ("answer", "solution")  # a column that fills Task.answer, if present (else "")
TRAIN = "env.dataset.train"  # how errors name the train rows
FORMATS = ".jsonl, .csv, .parquet or a `datasets` save_to_disk directory"

Row = dict[str, Any]


# ----------------------------------------------------------------------------------------- data
def read_rows(path: Path, what: str) -> list[Row]:
    """Every row of the data file or directory at `path` (ConfigError, one line, starting with
    `what`, if it is missing, unreadable, of no known format, empty or without a prompt column)."""
    return _read_rows_cached(*_file_key(path, what), what)


def _file_key(path: Path, what: str) -> tuple[Path, int, int]:
    """The data at `path` as the caches know it: resolved, its mtime and size (ConfigError, one
    line, starting with `what`, if it is missing)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what}: no such file or directory: {path}")
    stat = path.stat()
    return path.resolve(), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _read_rows_cached(path: Path, _mtime_ns: int, _size: int, what: str) -> list[Row]:
    try:
        rows = _read(path)
    except ConfigError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(f"{what}: cannot read {path}: {type(err).__name__}: {one_line(err)}") from None
    if not rows:
        raise ConfigError(f"{what}: {path} holds no row")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not any(row.get(column) is not None for column in PROMPT_COLUMNS):
            columns = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(
                f"{what}: row {number} of {path} has no 'prompt' or 'messages' column (it has: {columns})"
            )
        _check_prompt(row, f"{what}: row {number} of {path}")
    return rows


def _read(path: Path) -> list[Row]:
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"{path} is a directory: a `datasets` data set needs `pip install datasets`") from None
        return list(datasets.load_from_disk(str(path)))
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as lines:
            return [orjson.loads(line) for line in lines if line.strip()]
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as text:
            return list(csv.DictReader(text))
    if suffix == ".parquet":
        try:
            import pyarrow.parquet
        except ImportError:
            raise ConfigError(f"{path}: Parquet needs `pip install pyarrow`") from None
        return pyarrow.parquet.read_table(path).to_pylist()
    raise ConfigError(f"{path}: unknown format {suffix or '(no suffix)'!r}; a data file is {FORMATS}")


def _check_prompt(row: Row, where: str) -> None:
    prompt = prompt_of(row)
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return
    raise ConfigError(f"{where}: the prompt is neither a string nor a list of {{role, content}} messages")


def prompt_of(row: Row) -> str | list[dict[str, str]]:
    """The row's prompt as TRL has it: a string, or chat messages."""
    return row["prompt"] if row.get("prompt") is not None else row["messages"]


def columns_of(row: Row) -> Row:
    """The row's columns a reward function gets besides the prompt."""
    return {key: value for key, value in row.items() if key not in PROMPT_COLUMNS}


def held_out_draw(row: Row, where: str) -> float:
    """A stable number in [0, 1) of a row's content (its prompt and columns): the row is held out
    if it falls under held_out_fraction. Values JSON lacks (bytes, Decimal) count by their repr;
    a row JSON cannot hold even so is ConfigError (one line, starting with `where`)."""
    try:
        content = orjson.dumps(row, default=repr, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError as err:
        raise ConfigError(f"{where}: cannot hash the row for held_out_fraction: {one_line(err)}") from None
    digest = hashlib.sha256(content).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@functools.lru_cache(maxsize=8)
def _split_cached(train: Path, key: tuple[Path, int, int], fraction: float) -> tuple[list[Row], list[Row]]:
    """The train file's rows (`key`, of `train` as given) split by `held_out_fraction`: each run
    start asks for it several times, and hashing every row is not free. The lists are shared, never
    mutated."""
    return split_by_hash(_read_rows_cached(*key, TRAIN), fraction, f"{TRAIN}: row {{}} of {train}", "env.dataset")


def split_by_hash(rows: list[Row], fraction: float, where: str, section: str) -> tuple[list[Row], list[Row]]:
    """(train rows, held-out rows): a row is held out where its stable hash (`held_out_draw`) falls
    under `fraction`. ConfigError (one line) where a side is left empty, or a row cannot be hashed
    (`where` names it, formatted with its 1-based number); `section` names the setting."""
    held = [held_out_draw(row, where.format(number)) < fraction for number, row in enumerate(rows, 1)]
    kept = [row for row, out in zip(rows, held) if not out]
    if not kept or all(not out for out in held):
        side = "train" if not kept else "held-out"
        raise ConfigError(f"{section}.held_out_fraction={fraction} leaves no {side} row")
    return kept, [row for row, out in zip(rows, held) if out]


# -------------------------------------------------------------------------------------- rewards
class RewardFunction(Section):
    function: str = Field(
        description="module:function with TRL's signature (prompts, completions, completion_ids, **columns)"
    )
    weight: float = Field(1.0, description="its weight in the reward (the weighted sum of the functions' numbers)")


def load_reward_function(spec: str, columns: frozenset[str]) -> Callable[..., Any]:
    """The function `module:function`, if TRL can call it on rows of these `columns`: PluginError
    (one line) otherwise."""
    what = f"reward function {spec!r}"
    function = import_attribute(spec, what)
    if not callable(function):
        raise PluginError(f"{what} is a {type(function).__name__}, not a function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return function  # a builtin or C callable: called as it is
    params = signature.parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    if not {"prompts", "completions"} <= named or not (takes_any or "completion_ids" in named):
        raise PluginError(
            f"{what} has the signature {function.__name__}{signature}; a reward function is "
            "f(prompts, completions, completion_ids, **columns) -> list[float | None]"
        )
    unknown = sorted(required - {"prompts", "completions", "completion_ids"} - columns)
    if unknown:
        raise PluginError(
            f"{what} takes {', '.join(unknown)}, which the data set has no column of "
            f"(it has: {', '.join(sorted(columns))})"
        )
    # Every column is passed, as TRL passes them: a function without **kwargs must name them all.
    refused = sorted(columns - named)
    if refused and not takes_any:
        raise PluginError(
            f"{what} does not take the column(s) {', '.join(refused)}, which every call passes "
            f"(as TRL does): add **kwargs to {function.__name__}'s parameters"
        )
    return function


class DatasetEnv:
    """The `TextEnv` of a data set and its reward functions."""

    name = NAME

    def __init__(
        self,
        seed: int,
        train: list[Row],
        held_out: list[Row],
        rewards: list[tuple[Callable[..., Any], float, str]],
        shuffle: bool,
    ):
        self.seed, self.train, self.held_out, self.rewards, self.shuffle = seed, train, held_out, rewards, shuffle

    def row(self, index: int) -> Row:
        if index < 0:
            if not self.held_out:
                raise ValueError("dataset: this data set has no held-out rows (set held_out or held_out_fraction)")
            return self.held_out[(-index - 1) % len(self.held_out)]
        if not self.shuffle:
            return self.train[index % len(self.train)]
        return self.train[task_index(self.seed, index, len(self.train), NAME)]

    def task(self, index: int) -> Task:
        row = self.row(index)
        prompt = prompt_of(row)
        answer = next((str(row[c]) for c in ANSWER_COLUMNS if row.get(c) is not None), "")
        if isinstance(prompt, str):
            return Task(env=self.name, index=index, prompt=prompt, answer=answer)
        text = "\n".join(message["content"] for message in prompt)
        return Task(env=self.name, index=index, prompt=text, answer=answer, messages=list(prompt))

    def score(self, task: Task, completion: str) -> float:
        row = self.row(task.index)
        prompt = prompt_of(row)
        # As TRL passes it: a conversational prompt's completion is a list of one assistant message.
        answer: Any = completion if isinstance(prompt, str) else [{"role": "assistant", "content": completion}]
        columns = {key: [value] for key, value in columns_of(row).items()}
        total, counted = 0.0, 0
        for function, weight, spec in self.rewards:
            values = function(prompts=[prompt], completions=[answer], completion_ids=[None], **columns)
            if not isinstance(values, list | tuple) or len(values) != 1:
                raise ValueError(f"reward function {spec} returned {values!r:.80}, not a list of one number or None")
            value = values[0]
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"reward function {spec} returned {value!r:.80}, not a finite number or None")
            total, counted = total + weight * float(value), counted + 1
        return total if counted else 0.0


class DatasetConfig(TextEnvComponent):
    """dataset: tasks from a data file, rewards from functions of TRL's signature (docs/dataset.md)."""

    train: Path | None = Field(
        None, description=f"the train rows: {FORMATS} (a relative path is from where orch starts, stored absolute)"
    )
    held_out: Path | None = Field(None, description="held-out rows for evals (a file like train's)")
    held_out_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="else: this fraction of train's rows, by a stable hash of each row, held out (never trained on)",
    )
    rewards: list[RewardFunction] = Field(
        default_factory=list,
        description='reward functions: in TOML [{function = "my_rewards:exact", weight = 1.0}], '
        """with --set as JSON '[{"function": "my_rewards:exact"}]'""",
    )
    shuffle: bool = Field(
        True, description="each pass over the train rows in an order of its own (a function of the seed)"
    )
    success_threshold: float | None = Field(
        None, description="a reward at or above it solves the task (the pass of pass@k); None: no success notion"
    )

    @field_validator("train", "held_out")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        """A relative path is taken from where orch starts and stored absolute, so that a resume
        started elsewhere reads the same file."""
        return None if path is None else path.expanduser().absolute()

    @property
    def gives_messages(self) -> bool:  # type: ignore[override]
        """Whether its prompts are chat messages (the model then needs a chat template)."""
        try:
            return not isinstance(prompt_of(self._rows()[0][0]), str)
        except ConfigError:  # reported by preflight, which runs first
            return False

    def check(self, plan: RunPlan) -> None:
        if self.train is None:
            raise ValueError("env.dataset.train is not set: the file of the train rows")
        if not self.rewards:
            raise ValueError('env.dataset.rewards is empty: give at least one {function = "module:function"}')
        if self.held_out is not None and self.held_out_fraction:
            raise ValueError("env.dataset: give held_out or held_out_fraction, not both")
        if NAME in plan.eval_envs and self.held_out is None and not self.held_out_fraction:
            raise ValueError("evals of env 'dataset' need held-out rows: set env.dataset.held_out or held_out_fraction")

    def solved(self, reward: float) -> bool | None:
        return None if self.success_threshold is None else reward >= self.success_threshold

    def _rows(self) -> tuple[list[Row], list[Row]]:
        assert self.train is not None  # check() refused a run without it
        key = _file_key(self.train, TRAIN)
        rows = _read_rows_cached(*key, TRAIN)
        if self.held_out is not None:
            return rows, read_rows(self.held_out, "env.dataset.held_out")
        if not self.held_out_fraction:
            return rows, []
        return _split_cached(self.train, key, self.held_out_fraction)

    def _reward_functions(self, rows: list[Row]) -> list[tuple[Callable[..., Any], float, str]]:
        """The reward functions, checked against the columns of `rows` (train and held-out: evals
        score held-out rows with the same functions)."""
        columns = frozenset(key for row in rows for key in columns_of(row))
        return [(load_reward_function(r.function, columns), r.weight, r.function) for r in self.rewards]

    def preflight(self, seed: int) -> None:
        """The rows read and the reward functions imported and checked, before the run dir exists."""
        train, held_out = self._rows()
        self._reward_functions(train + held_out)

    def text_env(self, seed: int) -> DatasetEnv | None:  # type: ignore[override]  # served_env handles None
        if self.train is None:
            return None  # nothing to serve
        train, held_out = self._rows()
        return DatasetEnv(seed, train, held_out, self._reward_functions(train + held_out), self.shuffle)

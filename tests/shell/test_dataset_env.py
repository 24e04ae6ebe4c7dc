"""The `dataset` env (docs/dataset.md): tasks from a data file, rewards from functions of TRL's
signature; refusals before the run dir; a run on reverse_text's tasks written as JSONL learns
as the embedded default does, every logged reward the function's own on the logged completion."""

from __future__ import annotations

import csv
import os
import random
import sys
from pathlib import Path

import orjson
import pytest

from orchestrator.config import load_config
from orchestrator.contracts import ConfigError, RunPlan
from orchestrator.envs.dataset import DatasetConfig, held_out_draw, load_reward_function, read_rows
from orchestrator.envs.reverse_text import ReverseTextEnv, reversal_reward
from orchestrator.plugins import PluginError
from tests.support.cli import orch
from tests.support.logs import events
from tests.support.runs import run_args, sets

# reverse_text's reversal_reward, written again as a TRL user writes a reward function.
REWARDS = """
import difflib
import re

ANSWER = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)


def reversal(prompts, completions, completion_ids, **columns):
    rewards = []
    for prompt, completion in zip(prompts, completions):
        word, text = prompt[-1]["content"], completion[0]["content"]
        found = ANSWER.search(text)
        rewards.append(0.0 if found is None else difflib.SequenceMatcher(None, found.group(1), word[::-1]).ratio())
    return rewards


def only_long(prompts, completions, completion_ids, length, **columns):
    return [1.0 if n > 4 else None for n in length]


def never(prompts, completions, completion_ids, **columns):
    return [None for _ in prompts]


def plain_exact(prompts, completions, completion_ids, answer, **columns):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def wrong(completion, prompt):
    return [0.0]


def two_values(prompts, completions, completion_ids, **columns):
    return [1.0, 2.0]


def exact_no_kwargs(prompts, completions, completion_ids, answer):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def no_columns(prompts, completions, completion_ids):
    return [0.0 for _ in prompts]
"""


def reverse_text_rows(indices) -> list[dict]:
    env = ReverseTextEnv(seed=0)
    rows = []
    for index in indices:
        task = env.task(index)
        rows.append({"prompt": task.messages, "length": len(task.prompt)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "rev_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    yield site
    sys.modules.pop("rev_rewards", None)


def test_tasks_are_the_rows_and_rewards_the_functions_weighted_sum(rewards_module, tmp_path):
    rows = reverse_text_rows(range(64))
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    section = DatasetConfig(
        train=train,
        shuffle=False,
        rewards=[
            {"function": "rev_rewards:reversal", "weight": 1.0},
            {"function": "rev_rewards:only_long", "weight": 0.5},
        ],
    )
    env = section.text_env(0)
    reverse = ReverseTextEnv(seed=0)
    rng = random.Random(0)
    for index in range(64):
        task, theirs = env.task(index), reverse.task(index)
        assert (task.prompt, task.messages) == (theirs.prompt, theirs.messages)
        for completion in (theirs.answer, "<reversed_text>" + theirs.prompt + "</reversed_text>", "nope"):
            noisy = completion[: rng.randint(0, len(completion))] if rng.random() < 0.3 else completion
            bonus = 0.5 if len(theirs.prompt) > 4 else 0.0  # only_long's None adds nothing
            assert env.score(task, noisy) == reversal_reward(noisy, theirs.prompt) + bonus
    assert env.task(64).prompt == env.task(0).prompt  # the next pass, in file order without shuffle


def test_a_shuffled_pass_is_a_permutation_fixed_by_the_seed(rewards_module, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", reverse_text_rows(range(50)))
    section = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:reversal"}])
    first, again, other = section.text_env(1), section.text_env(1), section.text_env(2)
    passes = [[first.task(i).prompt for i in range(p * 50, (p + 1) * 50)] for p in range(2)]
    assert sorted(passes[0]) == sorted(passes[1]) == sorted(r["prompt"][0]["content"] for r in read_rows(train, "t"))
    assert passes[0] != passes[1]
    assert [again.task(i).prompt for i in range(100)] == passes[0] + passes[1]
    assert [other.task(i).prompt for i in range(50)] != passes[0]


def test_all_none_is_a_reward_of_zero_and_a_malformed_answer_fails_the_episode(rewards_module, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", reverse_text_rows(range(4)))
    env = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:never"}]).text_env(0)
    assert env.score(env.task(0), "anything") == 0.0
    env = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:two_values"}]).text_env(0)
    with pytest.raises(ValueError, match="not a list of one number or None"):
        env.score(env.task(0), "anything")


def test_a_csv_of_plain_prompts_passes_its_columns(rewards_module, tmp_path):
    path = tmp_path / "train.csv"
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, ["prompt", "answer"])
        writer.writeheader()
        writer.writerows([{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}])
    section = DatasetConfig(train=path, shuffle=False, rewards=[{"function": "rev_rewards:plain_exact"}])
    assert not section.gives_messages
    env = section.text_env(0)
    task = env.task(1)
    assert (task.prompt, task.messages, task.answer) == ("3+3=", None, "6")
    assert env.score(task, " 6") == 1.0 and env.score(task, "5") == 0.0


def test_a_held_out_fraction_is_disjoint_stable_and_its_file_alternative(rewards_module, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", reverse_text_rows(range(400)))
    section = DatasetConfig(train=train, held_out_fraction=0.25, rewards=[{"function": "rev_rewards:reversal"}])
    env = section.text_env(0)
    trained = {env.task(i).prompt for i in range(2000)}
    held = {env.task(-i).prompt for i in range(1, 400)}
    assert trained and held and not trained & held
    assert 0.15 < len(env.held_out) / 400 < 0.35
    assert {section.text_env(5).task(-i).prompt for i in range(1, 400)} == held  # no seed in the split
    held_file = write_jsonl(tmp_path / "held.jsonl", reverse_text_rows(range(-1, -9, -1)))
    env = DatasetConfig(train=train, held_out=held_file, rewards=[{"function": "rev_rewards:reversal"}]).text_env(0)
    assert [env.task(-i).prompt for i in range(1, 9)] == [ReverseTextEnv(0).task(-i).prompt for i in range(1, 9)]


def test_a_pass_boundary_keeps_both_passes_orders(rewards_module, tmp_path):
    """Episodes in flight straddle a pass boundary: alternating between two passes reuses their
    orders rather than reshuffling at each switch."""
    from orchestrator.envs.draw import pass_order

    train = write_jsonl(tmp_path / "train.jsonl", reverse_text_rows(range(10)))
    env = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:reversal"}]).text_env(3)
    assert [env.task(i).prompt for i in range(10, 12)] == [env.task(i).prompt for i in range(10, 12)]
    first, second = pass_order("dataset", 3, 0, 10), pass_order("dataset", 3, 1, 10)
    assert pass_order("dataset", 3, 0, 10) is first and pass_order("dataset", 3, 1, 10) is second
    pass_order("dataset", 3, 2, 10)
    assert pass_order("dataset", 3, 1, 10) is second and pass_order("dataset", 3, 0, 10) == first
    assert env.row(12) is env.train[second[2]]  # the env draws by that order


def test_a_null_prompt_beside_messages_is_the_messages(rewards_module, tmp_path):
    messages = [{"role": "user", "content": "abc"}]
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": None, "messages": messages, "length": 3}])
    env = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:reversal"}]).text_env(0)
    assert (env.task(0).prompt, env.task(0).messages) == ("abc", messages)


def test_a_held_out_fraction_hashes_rows_json_lacks():
    """Parquet or `datasets` columns of bytes and decimals (neither installed here) draw by their
    repr, stably; a row JSON cannot hold even so is one line."""
    import decimal

    rows = [{"prompt": f"{n}+{n}=", "blob": bytes([n]), "price": decimal.Decimal(n) / 4} for n in range(100)]
    draws = [held_out_draw(row, "here") for row in rows]
    assert draws == [held_out_draw(dict(row), "here") for row in rows] and len(set(draws)) == 100
    assert all(0 <= draw < 1 for draw in draws)
    with pytest.raises(ConfigError) as err:
        held_out_draw({"prompt": "a", "count": 2**70}, "env.dataset.train: row 2 of t.parquet")
    assert str(err.value) == (
        "env.dataset.train: row 2 of t.parquet: cannot hash the row for held_out_fraction: Integer exceeds 64-bit range"
    )


def test_evals_of_a_data_set_without_held_out_rows_are_refused():
    section = DatasetConfig(train=Path("t.jsonl"), rewards=[{"function": "m:f"}])
    with pytest.raises(ValueError, match="evals of env 'dataset' need held-out rows"):
        section.check(RunPlan(envs=("dataset",), eval_envs=("dataset",), inference="embedded"))


def test_a_reward_function_of_another_signature_is_one_line(rewards_module):
    with pytest.raises(PluginError) as err:
        load_reward_function("rev_rewards:wrong", frozenset())
    assert str(err.value) == (
        "reward function 'rev_rewards:wrong' has the signature wrong(completion, prompt); a reward function is "
        "f(prompts, completions, completion_ids, **columns) -> list[float | None]"
    )
    with pytest.raises(PluginError) as err:
        load_reward_function("rev_rewards:only_long", frozenset({"prompt_id"}))
    assert str(err.value) == (
        "reward function 'rev_rewards:only_long' takes length, which the data set has no column of (it has: prompt_id)"
    )


def test_a_reward_function_without_kwargs_must_name_every_column(rewards_module, tmp_path):
    """Every column is passed: a function without **kwargs that misses one is refused before the
    run (it would fail every episode with an unexpected keyword argument)."""
    assert load_reward_function("rev_rewards:exact_no_kwargs", frozenset({"answer"}))
    with pytest.raises(PluginError) as err:
        load_reward_function("rev_rewards:exact_no_kwargs", frozenset({"answer", "id", "level"}))
    assert str(err.value) == (
        "reward function 'rev_rewards:exact_no_kwargs' does not take the column(s) id, level, which every call "
        "passes (as TRL does): add **kwargs to exact_no_kwargs's parameters"
    )
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "2+2=", "answer": "4"}] * 4)
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "3+3=", "answer": "6", "id": 7}])
    section = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:exact_no_kwargs"}])
    env = section.text_env(0)
    assert env.score(env.task(0), "4") == 1.0
    with pytest.raises(PluginError, match=r"does not take the column\(s\) id,"):  # a held-out row's column
        section.model_copy(update={"held_out": held}).preflight(0)


@pytest.mark.parametrize(
    "make, sets_, message",
    [
        (None, [], "env.dataset.train: no such file or directory: "),
        ("no_prompt", [], "env.dataset.train: row 1 of "),
        ("ok", ['rewards=[{"function": "rev_rewards:wrong"}]'], "has the signature wrong(completion, prompt)"),
        ("ok", ['rewards=[{"function": "rev_rewards:no_columns"}]'], "does not take the column(s) length,"),
        ("ok", ['rewards=[{"function": "no_module:f"}]'], "module 'no_module' does not import"),
        ("ok", ["rewards=[]"], "env.dataset.rewards is empty"),
    ],
)
def test_orch_run_refuses_bad_data_or_rewards_with_exit_2_before_the_run_dir(
    rewards_module, tmp_path, make, sets_, message
):
    data = tmp_path / "train.jsonl"
    if make == "ok":
        write_jsonl(data, reverse_text_rows(range(4)))
    elif make == "no_prompt":
        write_jsonl(data, [{"question": "abc", "answer": "cba"}])
    settings = [f"env.dataset.train={data}", 'env.dataset.rewards=[{"function": "rev_rewards:reversal"}]']
    settings += [f"env.dataset.{s}" for s in sets_]
    result = orch(*run_args(tmp_path / "runs", "--env", "dataset", *sets(*settings)))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "runs" / "r").exists()


def test_the_section_is_one_of_the_config(tmp_path):
    config = load_config(
        overrides=['envs={"dataset": 1}', f"env.dataset.train={tmp_path / 't.jsonl'}"]
        + ['env.dataset.rewards=[{"function": "m:f", "weight": 2}]']
    )
    assert config.env_components()["dataset"].rewards[0].weight == 2.0
    with pytest.raises(ConfigError, match="env.dataset.train is not set"):
        load_config(overrides=['envs={"dataset": 1}'])


def test_a_relative_data_path_is_stored_absolute_so_a_resume_elsewhere_reads_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ['envs={"dataset": 1}', "env.dataset.train=data/t.jsonl", 'env.dataset.rewards=[{"function": "m:f"}]']
    config = load_config(overrides=overrides)
    stored = config.model_dump(mode="json")["env"]["dataset"]["train"]
    assert stored == str(tmp_path / "data" / "t.jsonl")
    monkeypatch.chdir("/")
    assert DatasetConfig.model_validate({"train": stored}).train == tmp_path / "data" / "t.jsonl"


@pytest.mark.slow
def test_reverse_text_as_a_data_set_learns_and_every_reward_is_the_functions(rewards_module, tmp_path):
    """The embedded default run (as `make run`), its tasks reverse_text's as JSONL and its reward
    a TRL-signature function: it learns, and every logged reward is the function's on the logged
    completion (decoded as the sampler decodes it)."""
    from transformers import AutoTokenizer

    from orchestrator.hf.model import ensure_tiny_model

    train = write_jsonl(tmp_path / "train.jsonl", reverse_text_rows(range(2048)))
    model = ensure_tiny_model(tmp_path / "cache", log=lambda s: None)
    summary = tmp_path / "summary.json"
    result = orch(
        *run_args(tmp_path / "runs", "--env", "dataset", "--json-summary", str(summary)),
        *sets(
            f"env.dataset.train={train}",
            'env.dataset.rewards=[{"function": "rev_rewards:reversal"}]',
            f"model.path={model}",
        ),
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr
    gain = orjson.loads(summary.read_bytes())["reward_gain"]
    assert gain >= 0.15, gain

    import rev_rewards

    env = DatasetConfig(train=train, rewards=[{"function": "rev_rewards:reversal"}]).text_env(0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    run_dir = tmp_path / "runs" / "r"
    tasks = {e["group_id"]: e["task_id"] for _, e in events(run_dir, "group_dispatched")}
    completed = [e for _, e in events(run_dir, "episode_completed") if e["ok"]]
    assert len(completed) >= 40 * 128
    for episode in completed:
        row = env.row(tasks[episode["group_id"]])
        sampled = [t for t, m in zip(episode["token_ids"], episode["mask"]) if m]
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        completion = [{"role": "assistant", "content": text}]
        assert episode["reward"] == rev_rewards.reversal([row["prompt"]], [completion], [sampled])[0]

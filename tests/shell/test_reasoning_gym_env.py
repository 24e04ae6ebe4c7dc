"""The `reasoning_gym` env (docs/reasoning_gym.md): reasoning-gym's data sets by name, tasks by
(seed, index), rewards by the data set's own score_answer, a held-out split that never meets the
train tasks; refusals before the run dir; a SIGKILLed and resumed run on the tiny model dispatches
the same tasks, every logged prompt the data set's question and every reward its score_answer."""

from __future__ import annotations

import os
import signal
from functools import partial

import pytest

from orchestrator.contracts import RunPlan
from orchestrator.envs.reasoning_gym import ReasoningGymConfig, extract_answer
from tests.support.cli import orch, spawn_orch, wait_until
from tests.support.logs import count_events, events
from tests.support.runs import sets

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra (make reasoning-gym)")

# A task space small enough to repeat itself within a few hundred items.
TINY_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


def test_every_task_is_its_data_sets_item_and_every_reward_its_score_answer():
    section = ReasoningGymConfig(
        datasets={"leg_counting": 1.0, "basic_arithmetic": 3.0},
        config={"basic_arithmetic": {"min_terms": 2, "max_terms": 3}},
        train_size=500,
        held_out_size=20,
    )
    env = section.text_env(11)
    theirs = {
        "leg_counting": reasoning_gym.create_dataset("leg_counting", seed=11, size=520),
        "basic_arithmetic": reasoning_gym.create_dataset(
            "basic_arithmetic", seed=11, size=520, min_terms=2, max_terms=3
        ),
    }
    picked = {"leg_counting": 0, "basic_arithmetic": 0}
    for index in [*range(200), *range(-1, -21, -1)]:
        name, item_index = env.source(index)
        item = theirs[name][item_index]
        picked[name] += 1
        task = env.task(index)
        assert task.prompt == item["question"] and task.answer == item["answer"]
        assert task.messages[-1] == {"role": "user", "content": item["question"]}
        assert task.messages[0]["role"] == "system" and "<answer>" in task.messages[0]["content"]
        for completion in (f"<answer>{item['answer']}</answer>", f"so <answer>{item['answer']}0</answer>", "none"):
            answer = reasoning_gym.utils.extract_answer(completion)
            assert env.score(task, completion) == theirs[name].score_answer(answer, item)
    assert picked["basic_arithmetic"] > 2 * picked["leg_counting"] > 0  # by the weights
    assert [section.text_env(11).task(i).prompt for i in range(50)] == [env.task(i).prompt for i in range(50)]
    assert [section.text_env(12).task(i).prompt for i in range(50)] != [env.task(i).prompt for i in range(50)]
    assert ReasoningGymConfig(seed=5).text_env(11).task(3) == ReasoningGymConfig().text_env(5).task(3)


def test_the_answer_is_extracted_by_tag_regex_or_whole_completion():
    text = "think <answer>1</answer> then <ans>2</ans> Final: 42\n<answer> 3 </answer>"
    assert extract_answer(text, "tag", "answer", None) == "3"
    assert extract_answer(text, "tag", "ans", None) == "2"
    assert extract_answer(text, "regex", "answer", r"Final: (\d+)") == "42"
    assert extract_answer(text, "regex", "answer", r"\d+") == "3"
    assert extract_answer(" 7 ", "completion", "answer", None) == "7"
    assert extract_answer("no tag", "tag", "answer", None) is None
    env = ReasoningGymConfig(datasets={"basic_arithmetic": 1.0}, extract="completion", system_prompt=None).text_env(0)
    task = env.task(0)
    assert task.messages == [{"role": "user", "content": task.prompt}]
    assert env.score(task, f" {task.answer}\n") == 1.0


def test_train_and_held_out_tasks_never_share_a_question():
    section = ReasoningGymConfig(
        datasets={"basic_arithmetic": 1.0},
        config={"basic_arithmetic": TINY_ARITHMETIC},
        train_size=300,
        held_out_size=40,
    )
    env = section.text_env(0)
    held = {env.task(-i).prompt for i in range(1, 41)}
    trained = {env.task(i).prompt for i in range(900)}
    assert len(held) > 10 and trained and not trained & held
    assert all(300 <= env.source(-i)[1] < 340 for i in range(1, 41))
    assert all(0 <= env.source(i)[1] < 300 for i in range(900))
    # The space repeats itself: the raw train items do ask held-out questions, which the env skips.
    raw = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=340, **TINY_ARITHMETIC)
    assert {raw[i]["question"] for i in range(300)} & held


def test_bad_settings_are_refused():
    plan = RunPlan(envs=("reasoning_gym",), eval_envs=(), inference="embedded")
    for settings, message in [
        ({"datasets": {}}, "datasets is empty"),
        ({"datasets": {"leg_counting": 0.0}}, "the weight of leg_counting is not positive"),
        ({"config": {"chain_sum": {}}}, "config names chain_sum, which datasets does not"),
        ({"extract": "regex"}, "needs env.reasoning_gym.regex"),
        ({"extract": "regex", "regex": "("}, "is not a regex"),
    ]:
        with pytest.raises(ValueError, match=message):
            ReasoningGymConfig(**settings).check(plan)


def refused(tmp_path, *settings: str, env: dict | None = None) -> str:
    result = orch(
        "run", "--runs-dir", str(tmp_path / "runs"), "--name", "r", "--env", "reasoning_gym", *sets(*settings), env=env
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: "), result.stderr
    assert not (tmp_path / "runs" / "r").exists()
    return lines[0]


def test_a_data_set_that_does_not_exist_is_one_line_before_the_run_dir(tmp_path):
    line = refused(tmp_path, 'env.reasoning_gym.datasets={"leg_countin": 1}')
    assert "env.reasoning_gym: no data set 'leg_countin' in reasoning-gym (it has " in line and "leg_counting" in line
    line = refused(tmp_path, 'env.reasoning_gym.config={"leg_counting": {"bogus": 1}}')
    assert "data set 'leg_counting' does not build: " in line and "bogus" in line


def test_without_the_package_the_run_is_refused_naming_the_extra(tmp_path):
    shadow = tmp_path / "shadow" / "reasoning_gym"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    pythonpath = os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])
    line = refused(tmp_path, env={**os.environ, "PYTHONPATH": pythonpath})
    assert line == "orch: error: env reasoning_gym needs the reasoning-gym package: pip install 'orch[reasoning-gym]'"


def episodes_completed(proc, run_dir, at_least: int) -> bool:
    return count_events(run_dir, "episode_completed") >= at_least or proc.poll() is not None


@pytest.mark.slow
def test_a_sigkilled_and_resumed_run_dispatches_the_same_tasks_and_logs_their_prompts_and_scores(tmp_path):
    """The embedded sampler on the tiny model, short completions (the reward is not what is tested
    here): killed once some episodes are in, resumed, stopped once more are. Each group keeps its
    task across the kill, tasks are dispatched in cursor order with none skipped or repeated, every
    logged prompt is the chat rendering of `create_dataset(...)[item]`'s question and every logged
    reward the data set's score_answer on the logged completion, decoded with the run's tokenizer."""
    from orchestrator.hf.model import ensure_tiny_model, load_tokenizer, render_prompt

    model = ensure_tiny_model(tmp_path / "cache", log=lambda s: None)
    run_dir = tmp_path / "runs" / "r"
    settings = sets(
        'env.reasoning_gym.datasets={"basic_arithmetic": 1, "leg_counting": 1}',
        "env.reasoning_gym.extract=completion",
        "env.reasoning_gym.system_prompt=",
        "rollout.max_new_tokens=8",
        "rollout.group_size=4",
        "batch.size=8",
        "zero_output_batches=100000",  # the untrained tiny model scores 0 on every task
        f"model.path={model}",
        "seed=3",
    )
    first = ["run", "--runs-dir", str(tmp_path / "runs"), "--name", "r", "--env", "reasoning_gym", *settings]
    for args in (first, ["run", "--resume", str(run_dir)]):
        at_least = (count_events(run_dir, "episode_completed") if args is not first else 0) + 8
        proc = spawn_orch(*args)
        wait_until(partial(episodes_completed, proc, run_dir, at_least), 240, f"{at_least} episodes in the log")
        assert proc.poll() is None, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL if args is first else signal.SIGTERM)
        proc.wait(timeout=120)

    dispatched = [e for _, e in events(run_dir, "group_dispatched")]
    task_of = {}
    for event in dispatched:
        assert task_of.setdefault(event["group_id"], event["task_id"]) == event["task_id"]
    assert [task_of[g] for g in sorted(task_of)] == list(range(len(task_of)))  # cursor order, none skipped
    assert count_events(run_dir, "run_resumed") == 1

    seed = 3
    env = ReasoningGymConfig(
        datasets={"basic_arithmetic": 1, "leg_counting": 1}, extract="completion", system_prompt=None
    ).text_env(seed)
    theirs = {name: reasoning_gym.create_dataset(name, seed=seed, size=100_200) for name in env.names}
    tokenizer = load_tokenizer(model)
    completed = [e for _, e in events(run_dir, "episode_completed") if e["ok"]]
    assert len(completed) >= 16
    for episode in completed:
        name, item_index = env.source(task_of[episode["group_id"]])
        item = theirs[name][item_index]
        first_sampled = episode["mask"].index(1)
        messages = [{"role": "user", "content": item["question"]}]
        assert episode["token_ids"][:first_sampled] == render_prompt(tokenizer, item["question"], messages)
        sampled = [t for t, m in zip(episode["token_ids"], episode["mask"]) if m]
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        assert episode["reward"] == theirs[name].score_answer(text.strip(), item)

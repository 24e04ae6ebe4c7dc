"""`[env.nemo_gym]`: its rows and split, the NeMo Gym config orch gives the servers it starts, and
the refusals before the run directory exists."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from orchestrator.contracts import ConfigError
from orchestrator.nemo_gym.config import NemoGymSettings, agent_name, run_config, split_rows
from tests.support.cli import orch
from tests.support.runs import run_args, sets

RESOURCES = {"reasoning_gym": {"resources_servers": {"reasoning_gym": {"entrypoint": "app.py", "domain": "x"}}}}
AGENT = {
    "my_agent": {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": "reasoning_gym"},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
            }
        }
    }
}
VLLM_MODEL = {"policy_model": {"responses_api_models": {"vllm_model": {"entrypoint": "app.py", "base_url": "x"}}}}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def rows_file(path: Path, n: int) -> Path:
    rows = [{"responses_create_params": {"input": f"task {i}"}, "answer": str(i)} for i in range(n)]
    return write(path, "\n".join(json.dumps(row) for row in rows) + "\n")


def settings(tmp_path: Path, *configs: dict, **fields) -> NemoGymSettings:
    files = [str(write(tmp_path / f"c{i}.yaml", json.dumps(c))) for i, c in enumerate(configs)]  # JSON is YAML
    return NemoGymSettings(servers=files, venv=tmp_path / "no-venv", **fields)


def test_the_run_config_answers_the_model_server_with_orchs_route_and_gives_each_server_a_port(tmp_path):
    section = settings(tmp_path, {**RESOURCES, **VLLM_MODEL}, AGENT)
    ports = itertools.count(9001)
    config = run_config(section, ("127.0.0.1", 8765), lambda host: next(ports))
    assert config["policy_model"] == {"responses_api_models": {"orch": {"host": "127.0.0.1", "port": 8765}}}
    resources = config["reasoning_gym"]["resources_servers"]["reasoning_gym"]
    agent = config["my_agent"]["responses_api_agents"]["simple_agent"]
    assert (resources["host"], resources["port"], resources["domain"]) == ("127.0.0.1", 9001, "x")
    assert agent["port"] == 9002 and agent["model_server"]["name"] == "policy_model"
    assert config["head_server"] == {"host": "127.0.0.1", "port": 9003} and config["dry_run"] is False
    assert "ray_head_node_address" not in config
    assert agent_name(section, config) == "my_agent"


def test_a_port_the_config_names_is_kept(tmp_path):
    pinned = json.loads(json.dumps(RESOURCES))
    pinned["reasoning_gym"]["resources_servers"]["reasoning_gym"]["port"] = 7000
    config = run_config(settings(tmp_path, pinned, AGENT), ("127.0.0.1", 1), lambda host: 9000, "10.0.0.1:6379")
    assert config["reasoning_gym"]["resources_servers"]["reasoning_gym"]["port"] == 7000
    assert config["ray_head_node_address"] == "10.0.0.1:6379"


def test_the_agent_must_be_one_and_call_the_model_server_orch_answers_for(tmp_path):
    two = {**AGENT, "other_agent": AGENT["my_agent"]}
    section = settings(tmp_path, RESOURCES, two)
    with pytest.raises(
        ConfigError, match=r"declare 2 agents \(my_agent, other_agent\): name one in env.nemo_gym.agent"
    ):
        agent_name(section, {**RESOURCES, **two})
    assert agent_name(section.model_copy(update={"agent": "other_agent"}), {**RESOURCES, **two}) == "other_agent"
    with pytest.raises(ConfigError, match="calls model server 'policy_model', not env.nemo_gym.model_server='m'"):
        agent_name(section.model_copy(update={"model_server": "m"}), {**RESOURCES, **AGENT})


def test_a_held_out_fraction_splits_the_rows_by_content_and_never_trains_on_a_held_out_one(tmp_path):
    section = NemoGymSettings(tasks=str(rows_file(tmp_path / "t.jsonl", 40)), held_out_fraction=0.25)
    train, held_out = split_rows(section)
    assert len(train) + len(held_out) == 40 and held_out
    assert not {r["answer"] for r in train} & {r["answer"] for r in held_out}
    assert split_rows(section) == (train, held_out)  # a function of the rows alone


def test_a_row_that_is_no_nemo_gym_task_is_refused_naming_its_line(tmp_path):
    bad = write(tmp_path / "t.jsonl", '{"responses_create_params": {"input": "x"}}\n{"prompt": "y"}\n')
    with pytest.raises(ConfigError, match=r"line 2 of .* has no responses_create_params with an input"):
        split_rows(NemoGymSettings(tasks=str(bad)))


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_tasks", "env.nemo_gym.tasks: no such file: "),
        ("no_venv", "no Python there (build NeMo Gym's venv with `make nemo-gym`)"),
        ("evals_without_held_out", "evals of env 'nemo_gym' need held-out rows"),
        ("given_without_url", "env.nemo_gym.launch = false needs env.nemo_gym.agent_url"),
    ],
)
def test_orch_run_refuses_bad_input_with_exit_2_before_the_run_dir(tmp_path, case, message):
    tasks = rows_file(tmp_path / "t.jsonl", 4) if case != "no_tasks" else tmp_path / "none.jsonl"
    settings_ = [
        "inference.kind=openai",
        'inference.openai.endpoints=["http://127.0.0.1:9"]',
        f"env.nemo_gym.tasks={tasks}",
        f"env.nemo_gym.venv={tmp_path / 'no-venv'}",
    ]
    if case == "evals_without_held_out":
        settings_ += ['eval.envs=["nemo_gym"]']
    if case == "given_without_url":
        settings_ += ["env.nemo_gym.launch=false"]
    result = orch(*run_args(tmp_path / "runs", "--env", "nemo_gym", *sets(*settings_)))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "runs" / "r").exists()

"""Components of the user's own package (docs/plugins.md): found by `module:Attribute` and by
entry points, refused in one line (exit 2, before the run dir) when they do not load or do not
meet their kind's contract."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from eventlog import EventLog
from orchestrator.config import ConfigError, load_config
from orchestrator.core.advantages import grpo_advantages
from tests.support.cli import orch
from tests.support.logs import events
from tests.support.runs import run_args, sets

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugins"
UPPERCASE = "my_task:UppercaseConfig"

# A trainer, a sampler and an algorithm of the user's own: each a subclass of its kind's base,
# each leaving a trace that shows it was the one used.
OWN_COMPONENTS = '''
from orchestrator.contracts import AlgorithmComponent
from orchestrator.core.advantages import grpo_advantages
from orchestrator.envs.fake import FakeEnvConfig
from orchestrator.inference.fake import FakeEpisodes, FakeEpisodesConfig
from orchestrator.trainers.fake import FakeTrainerConfig, FakeTrainer


class NotedTrainer(FakeTrainer):
    def batch_written(self, step, sha256):
        with open(self.run_dir / "noted_batches", "a") as out:
            out.write(f"{step}\\n")
        super().batch_written(step, sha256)


class NotedTrainerConfig(FakeTrainerConfig):
    """A fake trainer that notes each batch."""

    def build(self, ctx):
        return NotedTrainer(ctx.run_dir, self.step_time_s)


class OwnFakeEnvConfig(FakeEnvConfig):
    """The fake env's settings, its episodes made by the user's own backend."""

    def check(self, plan):
        pass


class OwnEpisodesConfig(FakeEpisodesConfig):
    """The fake env's episodes, by the user's own backend."""

    def check(self, plan):
        pass

    def build(self, ctx, envs):
        (section,) = ctx.env_sections.values()
        return FakeEpisodes(section, ctx.seed, ctx.version_now)


class Halved:
    def __init__(self, factor):
        self.factor = factor

    async def finalize_group(self, group_id, traces):
        return [self.factor * a for a in grpo_advantages([t.reward for t in traces])]


class HalvedConfig(AlgorithmComponent):
    """GRPO's advantages times a factor."""

    factor: float = 0.5

    def build(self, ctx):
        return Halved(self.factor)


class RowFile:
    """A metric sink: each row a line of a file in the run dir."""

    def __init__(self, settings, run_dir, identity):
        self.target = f"rowfile:{run_dir / settings['file']}"
        self.out = open(run_dir / settings["file"], "a")

    def write(self, rows, wall_time):
        self.out.writelines(f"{step} {name} {value}\\n" for step, name, value in rows)

    def flush(self):
        self.out.flush()

    def close(self):
        self.out.close()


class NoWrite:
    def flush(self):
        pass


NOT_A_COMPONENT = 42


class RaisingTaskConfig(__import__("my_task").UppercaseConfig):
    def text_env(self, seed):
        raise RuntimeError("no tasks today")
'''


def install_example(tmp_path: Path) -> Path:
    """The example as a package, installed by pip (offline, from a copy: a build leaves files in
    its source) into a directory of its own; that directory."""
    source, site = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, source)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(site), str(source)],
        check=True,
        timeout=300,
    )
    return site


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A directory of the user's modules (the example env and OWN_COMPONENTS as `own`), on the
    import path of this process and of the `orch` it spawns."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(EXAMPLE / "my_task.py", site / "my_task.py")
    (site / "own.py").write_text(OWN_COMPONENTS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    yield site
    for name in ("my_task", "own"):
        sys.modules.pop(name, None)


def test_an_env_by_module_attribute_with_its_settings_round_trips_through_the_stored_config(plugin_path):
    config = load_config(overrides=[f'envs={{"{UPPERCASE}": 1}}', f"env.{UPPERCASE}.length=6"])
    env = config.env_components()[UPPERCASE]
    assert type(env).__name__ == "UppercaseConfig" and env.length == 6
    stored = orjson.loads(config.to_json())
    assert stored["env"][UPPERCASE] == {"length": 6}
    assert load_config(base=stored).env_components()[UPPERCASE].length == 6
    task = env.text_env(0).task(3)
    assert env.text_env(0).score(task, task.answer) == 1.0 and env.solved(1.0)


def test_a_toml_section_of_a_dotted_module_name(plugin_path, tmp_path):
    (plugin_path / "pkg").mkdir()
    (plugin_path / "pkg" / "__init__.py").write_text("")
    shutil.copy(EXAMPLE / "my_task.py", plugin_path / "pkg" / "tasks.py")
    toml = tmp_path / "run.toml"
    toml.write_text('envs = { "pkg.tasks:UppercaseConfig" = 1.0 }\n[env."pkg.tasks:UppercaseConfig"]\nlength = 2\n')
    config = load_config(toml, overrides=["env.pkg.tasks:UppercaseConfig.length=3"])
    assert config.env_components()["pkg.tasks:UppercaseConfig"].length == 3
    assert load_config(toml).env_components()["pkg.tasks:UppercaseConfig"].length == 2
    sys.modules.pop("pkg.tasks", None), sys.modules.pop("pkg", None)


def test_a_plugin_default_section_is_kept_in_the_stored_config(plugin_path):
    config = load_config(overrides=[f'envs={{"{UPPERCASE}": 1}}'])
    assert orjson.loads(config.to_json())["env"][UPPERCASE] == {"length": 4}


@pytest.mark.parametrize(
    "override, message",
    [
        (
            'envs={"no_such_module:Env": 1}',
            "envs: env 'no_such_module:Env': module 'no_such_module' does not import "
            "(ModuleNotFoundError: No module named 'no_such_module')",
        ),
        ('envs={"my_task:Nope": 1}', "envs: env 'my_task:Nope': module 'my_task' has no attribute 'Nope'"),
        (
            'envs={"my_task:UppercaseEnv": 1}',
            "envs: env 'my_task:UppercaseEnv' is the class my_task.UppercaseEnv, not a subclass of "
            "orchestrator.contracts.EnvComponent",
        ),
        (
            'envs={"own:NOT_A_COMPONENT": 1}',
            "envs: env 'own:NOT_A_COMPONENT' is a int (42), not a subclass of orchestrator.contracts.EnvComponent",
        ),
        (
            'envs={"orchestrator.contracts:TextEnvComponent": 1}',
            "envs: env 'orchestrator.contracts:TextEnvComponent': TextEnvComponent does not define text_env, "
            "which every env defines",
        ),
        (
            "trainer.kind=my_task:UppercaseConfig",
            "trainer.kind: trainer 'my_task:UppercaseConfig' is the class my_task.UppercaseConfig, not a "
            "subclass of orchestrator.contracts.TrainerComponent",
        ),
        (
            'metrics.plugins={"own:NoWrite": {}}',
            "metrics.plugins: metric sink 'own:NoWrite': NoWrite has no write, close (a sink has "
            "write(rows, wall_time), flush() and close())",
        ),
        (
            'metrics.plugins={"own:NOT_A_COMPONENT": {}}',
            "metrics.plugins: metric sink 'own:NOT_A_COMPONENT' is a int (42), not a class",
        ),
        (
            f"env.{UPPERCASE}.length=0",
            f"env: {UPPERCASE}.length: Input should be greater than or equal to 1",
        ),
    ],
)
def test_a_plugin_that_does_not_load_or_meet_the_contract_is_one_line(plugin_path, override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == f"invalid config: {message}"


def test_a_module_that_raises_on_import_is_named_with_where(plugin_path):
    (plugin_path / "broken.py").write_text("x = 1\nraise RuntimeError('half written')\n")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=['envs={"broken:Env": 1}'])
    assert str(err.value) == (
        "invalid config: envs: env 'broken:Env': module 'broken' does not import "
        f"(RuntimeError: half written at {plugin_path / 'broken.py'}:2)"
    )


def test_an_error_a_library_raises_for_the_users_class_names_the_users_line(plugin_path):
    """pydantic refuses a field without annotation inside pydantic: the line named is the class's."""
    (plugin_path / "unannotated.py").write_text(
        "from orchestrator.contracts import TextEnvComponent\n\n\n"
        "class Env(TextEnvComponent):\n"
        "    name = 'unannotated'\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(overrides=['envs={"unannotated:Env": 1}'])
    assert "PydanticUserError: A non-annotated attribute was detected" in str(err.value)
    assert str(err.value).endswith(f" at {plugin_path / 'unannotated.py'}:4)")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env", "no_such_module:Env"], "module 'no_such_module' does not import"),
        (["--env", "own:RaisingTaskConfig"], "text_env"),
        (
            ["--env", "nope"],
            "unknown env 'nope'; known: dataset, fake, nemo_gym, reasoning_gym, reverse_text, verifiers",
        ),
    ],
)
def test_orch_run_refuses_a_bad_plugin_with_exit_2_before_the_run_dir(plugin_path, tmp_path, args, message):
    result = orch(*run_args(tmp_path / "runs", *args), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "runs" / "r").exists()


def test_own_trainer_sampler_and_algorithm_run_a_fake_job(plugin_path, tmp_path):
    result = orch(
        *run_args(tmp_path, "--env", "own:OwnFakeEnvConfig", steps=3),
        *sets(
            "trainer.kind=own:NotedTrainerConfig",
            "inference.kind=own:OwnEpisodesConfig",
            "algorithm.name=own:HalvedConfig",
            "algorithm.own:HalvedConfig.factor=0.25",
            "metrics.plugins.own:RowFile.file=rows.txt",
            "batch.size=16",
            "rollout.group_size=4",
        ),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "r"
    assert (run_dir / "noted_batches").read_text().split() == ["1", "2", "3"]
    steps_with_rows = {int(line.split()[0]) for line in (run_dir / "rows.txt").read_text().splitlines()}
    assert {1, 2, 3} <= steps_with_rows
    with EventLog.open_reader(run_dir / "events.db") as log:
        stored = orjson.loads(log.meta["config"])
    assert stored["algorithm"]["own:HalvedConfig"] == {"factor": 0.25}
    assert stored["trainer"]["own:NotedTrainerConfig"] == {"step_time_s": 0.0}
    rewards = {e["episode_id"]: e["reward"] for _, e in events(run_dir, "episode_completed")}
    finalized = events(run_dir, "background_finalized")
    assert finalized
    for _, result_event in finalized:
        expected = [0.25 * a for a in grpo_advantages([rewards[t] for t in result_event["episode_ids"]])]
        assert result_event["advantages"] == pytest.approx(expected)


def test_an_installed_package_registers_an_env_by_entry_point(tmp_path, monkeypatch):
    """The example as a package: pip installs it (its own copy, offline), its entry point of
    `orch.envs` names the env `uppercase`."""
    site = install_example(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    try:
        config = load_config(overrides=['envs={"uppercase": 1}', "env.uppercase.length=5"])
        assert type(config.env_components()["uppercase"]).__name__ == "UppercaseConfig"
        assert config.env_components()["uppercase"].length == 5
        with pytest.raises(
            ConfigError,
            match=r"unknown env 'nope'; known: dataset, fake, nemo_gym, reasoning_gym, reverse_text, uppercase, "
            r"verifiers",
        ):
            load_config(overrides=['envs={"nope": 1}'])
    finally:
        sys.modules.pop("my_task", None)


@pytest.mark.slow
def test_the_example_env_runs_as_an_installed_plugin_and_its_rewards_are_its_scores(tmp_path):
    """A real run (embedded sampler, hf trainer, tiny model) of the installed example env: every
    episode's prompt is its task's, every reward the env's score of the logged completion."""
    from transformers import AutoTokenizer

    from orchestrator.hf.model import ensure_tiny_model

    site = install_example(tmp_path)
    model = ensure_tiny_model(tmp_path / "cache", log=lambda s: None)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    result = orch(
        *run_args(tmp_path / "runs", "--env", "uppercase", steps=2),
        *sets("batch.size=16", "rollout.group_size=4", "rollout.max_inflight=16", f"model.path={model}"),
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    sys.path.insert(0, str(site))
    try:
        from my_task import UppercaseEnv
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("my_task", None)
    tasks = UppercaseEnv(seed=0, length=4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    dispatched = {e["group_id"]: e["task_id"] for _, e in events(tmp_path / "runs" / "r", "group_dispatched")}
    completed = [e for _, e in events(tmp_path / "runs" / "r", "episode_completed") if e["ok"]]
    assert len(completed) >= 32
    for episode in completed:
        task = tasks.task(dispatched[episode["group_id"]])
        sampled = [t for t, m in zip(episode["token_ids"], episode["mask"]) if m]
        prompt = [t for t, m in zip(episode["token_ids"], episode["mask"]) if not m]
        assert tokenizer.decode(prompt, skip_special_tokens=True).endswith(task.prompt)
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        assert episode["reward"] == difflib.SequenceMatcher(None, text.strip(), task.answer).ratio()
        assert episode["reward"] == tasks.score(task, text)


def test_the_example_stays_short():
    """The documented example is the contract in about thirty lines of code."""
    code = [
        line
        for line in textwrap.dedent((EXAMPLE / "my_task.py").read_text()).splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert len(code) <= 32

"""`env.verifiers`'s settings: a verifiers (v1) taskset, and the checks made of it before a run.

Light (pydantic and the stdlib): verifiers is imported by the checks, when a run names this env,
and by the env (:mod:`orchestrator.verifiers.env`); the component is :mod:`.component`.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from orchestrator.contracts import Section


class VerifiersSettings(Section):
    """A verifiers (v1) taskset and how its agents run: the `env.verifiers` section's settings."""

    taskset: str | None = Field(
        None,
        description="taskset id: an importable module exporting one vf.Taskset (verifiers' own, an "
        "installed package, or a module under `path`)",
    )
    path: list[str] = Field(
        default_factory=list,
        description="directories put first on sys.path to import the taskset from (stored absolute, so a "
        "resume finds them from any directory)",
    )
    taskset_config: dict[str, Any] = Field(
        default_factory=dict, description="the taskset's own config (its vf.TasksetConfig fields)"
    )
    env_id: str = Field(
        "", description="a verifiers Env to pair with the taskset (empty: the taskset's own, else SingleAgentEnv)"
    )
    harness: dict[str, Any] = Field(
        default_factory=lambda: {"id": "null"},
        description="the agent's harness config (`null`: verifiers' plain chat loop)",
    )
    runtime: dict[str, Any] = Field(
        default_factory=lambda: {"type": "subprocess"},
        description="where the harness runs (verifiers' default is a remote sandbox)",
    )
    max_turns: int | None = Field(None, ge=1, description="model turns per episode (None: the env decides)")
    renderer: dict[str, Any] | None = Field(
        None, description="a renderers RendererConfig (None: from the run's model dir)"
    )
    rollout_timeout_s: float = Field(300.0, gt=0, description="bound on one agent run (verifiers' timeout.rollout)")
    setup_timeout_s: float = Field(
        600.0, gt=0, description="bound on an agent's setup (the first builds the harness's uv environment)"
    )
    scoring_timeout_s: float = Field(120.0, gt=0, description="bound on an episode's scoring")
    held_out: dict[str, Any] = Field(
        default_factory=dict,
        description="the taskset's held-out tasks, which evals draw from and training never does: a verifiers "
        "task match (`idx`: positions and 'start:stop' ranges; `ids`; `keys`; `names`); empty: none, no evals",
    )
    success_threshold: float | None = Field(
        1.0, description="a reward at or above it solves the task (the pass of pass@k); None: no success notion"
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        return [str(Path(p).expanduser().resolve()) for p in value]

    def env_config(self, seats: list[str]) -> dict[str, Any]:
        """The verifiers EnvConfig data of this section: the agent settings on each of `seats`."""
        timeouts = {"rollout": self.rollout_timeout_s, "setup": self.setup_timeout_s, "scoring": self.scoring_timeout_s}
        agent = {"harness": self.harness, "runtime": self.runtime, "max_turns": self.max_turns, "timeout": timeouts}
        return {
            "id": self.env_id,
            "taskset": {**self.taskset_config, "id": self.taskset},
            **{seat: agent for seat in seats},
        }


@functools.cache  # a taskset's env is loaded once per process
def check_env(section_json: str) -> None:
    section = VerifiersSettings.model_validate_json(section_json)
    add_path(section.path)
    taskset = section.taskset or ""
    module = taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is None and importlib.util.find_spec(module) is None:
        where = f" (looked on sys.path and in {', '.join(section.path)})" if section.path else ""
        raise ValueError(
            f"env.verifiers.taskset {taskset!r}: no module {module!r}{where}; install the taskset's "
            "package or add its directory to env.verifiers.path"
        )
    env = load_env(section)
    if not trainable_agents(env):
        raise ValueError(
            f"env.verifiers.taskset {taskset!r}: its env {type(env).__name__} has no trainable agent, "
            "so its episodes have nothing to train"
        )
    if section.held_out:
        train, held_out = split_taskset(env.taskset, section.held_out)
        for part, name in ((held_out, "held-out"), (train, "train")):
            if next(iter(part), None) is None:
                raise ValueError(
                    f"env.verifiers.held_out {section.held_out}: it leaves taskset {taskset!r} no {name} task"
                )


def add_path(paths: list[str]) -> None:
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def load_env(section: VerifiersSettings):
    """The verifiers Env of `section` (ValueError, one line, if verifiers refuses it)."""
    import verifiers.v1 as vf
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import agent_config_fields

    add_path(section.path)
    try:
        config_type = vf.env_config_type(section.taskset, section.env_id)
        seats = list(agent_config_fields(config_type()))
        return vf.load_environment(vf.resolve_env_config(section.env_config(seats)))
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"env.verifiers.taskset {section.taskset!r}: {problems}") from None
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"env.verifiers.taskset {section.taskset!r}: {first}") from None


def split_taskset(taskset, held_out: dict[str, Any]):
    """(train tasks, held-out tasks) of a verifiers taskset: views without and with the tasks
    the `held_out` task match names (ValueError, one line, if verifiers refuses the match: a
    field it lacks, a negative position, an identity match on an infinite taskset)."""
    from pydantic import ValidationError

    where = f"env.verifiers.held_out {held_out}"
    try:
        return taskset.exclude(**held_out), taskset.include(**held_out)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"{where}: {problems}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {str(err).strip().splitlines()[0]}") from None


def trainable_agents(env) -> list[str]:
    """The env's agent seats that train the policy: each declared agent, as the env's own
    `setup()` leaves it (a judge seat is marked untrainable there)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    probe = vf.ModelContext(model="orch-probe", client=vf.EvalClientConfig(base_url="http://orch.invalid/v1"))
    agents = env._episode_agents(probe, [], None, None)
    # On a loop of its own (a thread): the check runs while the config is validated, maybe in a loop.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, env.setup(agents)).result()
    return [name for name in agent_config_fields(env.config) if getattr(agents, name).trainable]

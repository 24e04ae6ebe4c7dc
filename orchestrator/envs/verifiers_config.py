"""The `verifiers` env's config section (light: pydantic and the stdlib; verifiers is imported by
:func:`preflight` and the backend only)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class VerifiersSection(BaseModel):
    """A verifiers (v1) taskset as an orch env: its episodes are verifiers' `run_slot`s, their
    model calls go through `inference.endpoints` (vLLM started with --enable-scale-out)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    taskset: str | None = Field(None, description="taskset id: an importable module exporting one vf.Taskset "
                                "(verifiers' own, an installed package, or a module under `path`)")
    path: list[str] = Field(default_factory=list, description="directories put first on sys.path to import the "
                            "taskset from (stored absolute, so a resume finds them from any directory)")
    taskset_config: dict[str, Any] = Field(default_factory=dict, description="the taskset's own config "
                                           "(its vf.TasksetConfig fields)")
    env_id: str = Field("", description="a verifiers Env to pair with the taskset (empty: the taskset's own, "
                        "else SingleAgentEnv)")
    harness: dict[str, Any] = Field(default_factory=lambda: {"id": "null"},
                                    description="the agent's harness config (`null`: verifiers' plain chat loop)")
    runtime: dict[str, Any] = Field(default_factory=lambda: {"type": "subprocess"},
                                    description="where the harness runs (verifiers' default is a remote sandbox)")
    max_turns: int | None = Field(None, ge=1, description="model turns per episode (None: the env decides)")
    model: str | None = Field(None, description="the HF model dir vLLM serves (or its served name): its tokenizer "
                              "renders the chat template client-side, its name is sent with each call")
    renderer: dict[str, Any] | None = Field(None, description="a renderers RendererConfig (None: from the model)")
    rollout_timeout_s: float = Field(300.0, gt=0, description="bound on one agent run (verifiers' "
                                     "timeout.rollout)")
    setup_timeout_s: float = Field(600.0, gt=0, description="bound on an agent's setup (the first builds the "
                                   "harness's uv environment)")
    scoring_timeout_s: float = Field(120.0, gt=0, description="bound on an episode's scoring")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        return [_absolute(p) for p in value]

    @field_validator("model")
    @classmethod
    def _absolute_model(cls, value: str | None) -> str | None:
        # vLLM serves a local model dir under the path it was given: start it with the absolute one.
        return value if value is None or not Path(value).expanduser().exists() else _absolute(value)

    def env_config(self, seats: list[str]) -> dict[str, Any]:
        """The verifiers EnvConfig data of this section: the agent settings on each of `seats`."""
        timeouts = {"rollout": self.rollout_timeout_s, "setup": self.setup_timeout_s,
                    "scoring": self.scoring_timeout_s}
        agent = {"harness": self.harness, "runtime": self.runtime, "max_turns": self.max_turns, "timeout": timeouts}
        return {"id": self.env_id, "taskset": {**self.taskset_config, "id": self.taskset},
                **{seat: agent for seat in seats}}


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def check(section: VerifiersSection) -> None:
    """ValueError (one line) unless the taskset can run: verifiers installed, the taskset module
    found, and its env has a trainable agent (what orch trains on)."""
    if section.taskset is None:
        raise ValueError("env 'verifiers' needs verifiers.taskset (an importable taskset module)")
    if section.model is None:
        raise ValueError("env 'verifiers' needs verifiers.model (the HF model dir the endpoints serve)")
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError("env 'verifiers' needs the verifiers package: pip install 'orch[verifiers]'")
    _check_env(section.model_dump_json())


@functools.cache  # a config is validated several times (a resume: stored, then requested)
def _check_env(section_json: str) -> None:
    section = VerifiersSection.model_validate_json(section_json)
    add_path(section.path)
    module = section.taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is None and importlib.util.find_spec(module) is None:
        where = f" (looked on sys.path and in {', '.join(section.path)})" if section.path else ""
        raise ValueError(f"verifiers.taskset {section.taskset!r}: no module {module!r}{where}; install the taskset's "
                         "package or add its directory to verifiers.path")
    env = load_env(section)
    if not trainable_agents(env):
        raise ValueError(f"verifiers.taskset {section.taskset!r}: its env {type(env).__name__} has no trainable agent, "
                         "so its episodes have nothing to train")


def add_path(paths: list[str]) -> None:
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def load_env(section: VerifiersSection):
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
        raise ValueError(f"verifiers.taskset {section.taskset!r}: {problems}") from None
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"verifiers.taskset {section.taskset!r}: {first}") from None


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

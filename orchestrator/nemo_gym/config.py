"""`[env.nemo_gym]`: its settings, its task rows and the NeMo Gym config orch gives the servers it
starts (docs/nemo_gym.md).

NeMo Gym describes servers in YAML: each top-level key is a server instance,
``NAME: {TYPE: {SERVER: {entrypoint: app.py, ...}}}`` with TYPE one of `SERVER_TYPES`. orch reads
the files named in `servers`, merges them by top-level key (a later file's instance replaces an
earlier one of the same name), and adds what a run needs: the model server the agent calls
(`model_server`) is orch's own route, every instance gets a host and a free port where it names
none, and the keys NeMo Gym's servers read at start-up (`head_server`, `dry_run`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import orjson
from pydantic import Field, field_validator

from orchestrator.contracts import ConfigError, Section
from orchestrator.envs.dataset import split_by_hash
from orchestrator.notices import one_line

NAME = "nemo_gym"
SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")
AGENTS = "responses_api_agents"
MODELS = "responses_api_models"
ROUTE_SERVER = "orch"  # the name orch's route has among the model servers
HOST = "127.0.0.1"

Row = dict[str, Any]


class NemoGymSettings(Section):
    venv: Path = Field(
        Path(".venv-nemo-gym"),
        description="NeMo Gym's virtual environment (Python 3.12; `make nemo-gym` builds it); stored absolute",
    )
    servers: list[str] = Field(
        default_factory=list,
        description="NeMo Gym config files (YAML) of the resources server(s) and the agent: a path, or one "
        "relative to NeMo Gym's install (its built-ins, e.g. resources_servers/reasoning_gym/configs/...)",
    )
    agent: str | None = Field(None, description="the agent's instance name in `servers` (None: the only agent)")
    model_server: str = Field(
        "policy_model", description="the model server's instance name the agent calls: orch's route answers for it"
    )
    tasks: str | None = Field(
        None,
        description="the train rows: a JSONL file in NeMo Gym's format (each row a `responses_create_params` "
        "and the fields its resources server verifies with), a path or one relative to NeMo Gym's install",
    )
    held_out: str | None = Field(None, description="held-out rows for evals (a file like tasks')")
    held_out_fraction: float = Field(
        0.0, ge=0, lt=1, description="else: this fraction of the rows, by a stable hash of each row, held out"
    )
    launch: bool = Field(True, description="orch starts the servers and stops them at the end (else: `agent_url`)")
    agent_url: str | None = Field(
        None, description="with launch = false: the agent server a user started (its model server: orch's route)"
    )
    route_host: str = Field(HOST, description="where orch's model route listens")
    route_port: int = Field(0, ge=0, lt=65536, description="its port (0: a free one; servers a user starts need one)")
    ray_address: str | None = Field(
        None, description="a Ray cluster the servers join (None: they run without Ray, which most servers never use)"
    )
    ready_timeout_s: float = Field(120.0, gt=0, description="the longest wait for the started servers to answer")
    stop_timeout_s: float = Field(10.0, gt=0, description="SIGTERM to SIGKILL, when the run stops its servers")
    episode_timeout_s: float = Field(600.0, gt=0, description="the longest one agent /run may take")
    success_threshold: float | None = Field(
        1.0, description="a reward at or above it solves the task (the pass of pass@k); None: no success notion"
    )

    @field_validator("venv")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        """Stored absolute, so that a resume started elsewhere finds the same venv."""
        return path.expanduser().absolute()

    def site_packages(self) -> Path | None:
        """The venv's site-packages (where NeMo Gym's built-in servers are installed), if any."""
        found = sorted(self.venv.glob("lib/python3.*/site-packages"))
        return found[-1] if found else None

    def resolve(self, name: str, what: str) -> Path:
        """A file named in the section: as given (from where orch runs), else under NeMo Gym's
        install; ConfigError (one line) if neither has it."""
        given = Path(name).expanduser()
        if given.exists():
            return given.absolute()
        installed = self.site_packages()
        if installed is not None and not given.is_absolute() and (installed / given).exists():
            return installed / given
        if given.is_absolute():
            raise ConfigError(f"env.nemo_gym.{what}: no such file: {name}")
        where = f" nor under NeMo Gym's install ({installed})" if installed is not None else ""
        raise ConfigError(f"env.nemo_gym.{what}: no file {name} in {Path.cwd()}{where}")


# ------------------------------------------------------------------------------------------ rows
def read_rows(path: Path, what: str) -> list[Row]:
    stat = path.stat()
    return _read_rows(path, stat.st_mtime_ns, stat.st_size, what)


@functools.lru_cache(maxsize=8)
def _read_rows(path: Path, _mtime_ns: int, _size: int, what: str) -> list[Row]:
    """A JSONL file's rows, each checked to be a NeMo Gym task (ConfigError, one line, otherwise)."""
    rows = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise ConfigError(f"env.nemo_gym.{what}: cannot read {path}: {one_line(err)}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as err:
            raise ConfigError(f"env.nemo_gym.{what}: line {number} of {path} is not JSON: {one_line(err)}") from None
        params = row.get("responses_create_params") if isinstance(row, dict) else None
        if not isinstance(params, dict) or "input" not in params:
            raise ConfigError(
                f"env.nemo_gym.{what}: line {number} of {path} has no responses_create_params with an input "
                "(NeMo Gym's task format)"
            )
        rows.append(row)
    if not rows:
        raise ConfigError(f"env.nemo_gym.{what}: {path} holds no row")
    return rows


def split_rows(settings: NemoGymSettings) -> tuple[list[Row], list[Row]]:
    """(train rows, held-out rows) as the section gives them (ConfigError if a side it asks for
    is left empty)."""
    if settings.tasks is None:
        raise ConfigError("env.nemo_gym.tasks is not set: the JSONL file of the train rows")
    rows = read_rows(settings.resolve(settings.tasks, "tasks"), "tasks")
    if settings.held_out is not None:
        return rows, read_rows(settings.resolve(settings.held_out, "held_out"), "held_out")
    if not settings.held_out_fraction:
        return rows, []
    return split_by_hash(rows, settings.held_out_fraction, "env.nemo_gym.tasks: row {}", "env.nemo_gym")


# --------------------------------------------------------------------------------- NeMo Gym config
def server_directory(settings: NemoGymSettings, kind: str, server: str) -> Path:
    """Where a server's code is: ``KIND/SERVER`` from where orch runs (a user's own), else NeMo Gym's."""
    local = Path.cwd() / kind / server
    if local.is_dir():
        return local
    installed = settings.site_packages()
    return (installed or settings.venv) / kind / server


def server_instances(config: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Each server instance of a NeMo Gym config: its name -> (type, server, settings)."""
    found = {}
    for name, value in config.items():
        if not isinstance(value, dict) or len(value) != 1:
            continue
        ((kind, inner),) = value.items()
        if kind in SERVER_TYPES and isinstance(inner, dict) and len(inner) == 1:
            ((server, settings),) = inner.items()
            if isinstance(settings, dict):
                found[name] = (kind, server, settings)
    return found


def load_servers(settings: NemoGymSettings) -> dict[str, Any]:
    """The section's NeMo Gym config files merged by instance name (ConfigError, one line, for a
    file that is missing or not a YAML mapping)."""
    import yaml

    if not settings.servers:
        raise ConfigError("env.nemo_gym.servers is empty: give the NeMo Gym config file(s) of its servers")
    merged: dict[str, Any] = {}
    for name in settings.servers:
        path = settings.resolve(name, "servers")
        try:
            config = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"env.nemo_gym.servers: cannot read {path}: {one_line(err)}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"env.nemo_gym.servers: {path} is not a YAML mapping of server instances")
        merged.update(config)
    return merged


def agent_name(settings: NemoGymSettings, config: dict[str, Any]) -> str:
    """The agent instance episodes are posted to, checked to call `model_server` (ConfigError)."""
    instances = server_instances(config)
    agents = [name for name, (kind, _, s) in instances.items() if kind == AGENTS and "entrypoint" in s]
    declared = ", ".join(agents) or "none"
    if settings.agent is None and len(agents) != 1:
        raise ConfigError(
            f"env.nemo_gym.servers declare {len(agents)} agents ({declared}): name one in env.nemo_gym.agent"
        )
    name = settings.agent if settings.agent is not None else agents[0]
    if name not in agents:
        raise ConfigError(f"env.nemo_gym.agent {name!r} is not an agent of env.nemo_gym.servers (agents: {declared})")
    ref = instances[name][2].get("model_server")
    called = ref.get("name") if isinstance(ref, dict) else None
    if called != settings.model_server:
        raise ConfigError(
            f"agent {name!r} calls model server {called!r}, not env.nemo_gym.model_server={settings.model_server!r} "
            "(orch's route answers for that one)"
        )
    return name


def run_config(
    settings: NemoGymSettings, route: tuple[str, int], free_port: Any, ray_address: str | None = None
) -> dict[str, Any]:
    """The NeMo Gym config of a run's servers (module docstring): `route` (host, port) answers
    for the model server; `free_port(host)` gives a port to each instance that names none."""
    config = dict(load_servers(settings))
    config[settings.model_server] = {MODELS: {ROUTE_SERVER: {"host": route[0], "port": route[1]}}}
    for name, (kind, server, own) in server_instances(config).items():
        if name == settings.model_server:
            continue
        own = {**own, "host": own.get("host", HOST)}
        own["port"] = own.get("port") or free_port(own["host"])
        config[name] = {kind: {server: own}}
    config["head_server"] = {"host": HOST, "port": free_port(HOST)}  # read at start-up; nothing serves it
    config["dry_run"] = False
    if ray_address:
        config["ray_head_node_address"] = ray_address
    return config

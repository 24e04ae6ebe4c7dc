"""Helpers for the replay tests: SimWorld runs written into real orch event logs, and the CLI."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from eventlog import EventLog
from orchestrator.core import events as ev
from orchestrator.core.events import decode_event
from orchestrator.sim import SimOptions, SimWorld
from replay.cli import replay_command
from replay.logs import write_events


def sim_params(seed: int, **kw) -> ev.CoreParams:
    base = dict(
        seed=seed,
        env_ratios={"a": 1.0, "b": 1.5},
        group_size=4,
        batch_size=16,
        max_inflight=24,
        max_steps=10,
        max_off_policy_steps=2,
        zero_output_batches=1000,
    )
    base.update(kw)
    return ev.CoreParams(**base)


def sim_run(params: ev.CoreParams, seed: int, options: SimOptions | None = None) -> SimWorld:
    world = SimWorld(params, seed=seed, options=options)
    world.run()
    return world


def sim_log(path: Path, params: ev.CoreParams, seed: int, options: SimOptions | None = None) -> Path:
    """Run a SimWorld and write its stream into an orch log at `path` (a .db file)."""
    world = sim_run(params, seed, options)
    write_events(path, world.log, meta={"seed": str(seed)})
    return path


def decoded(path) -> list[tuple[int, object]]:
    """Every event of a (small) log, decoded with its payload: (seq, event)."""
    with EventLog.open_reader(path) as log:
        return [(seq, decode_event(kind, data, payload)) for seq, _ts, kind, data, payload in log.read_rows()]


def rows(path) -> list[tuple[int, str, dict]]:
    """Every event of a (small) log: (seq, kind, data)."""
    with EventLog.open_reader(path) as log:
        return [(seq, kind, orjson.loads(data)) for seq, _ts, kind, data in log.read_raw()]


class Cli:
    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args):
        return self.runner.invoke(replay_command, [str(a) for a in args], catch_exceptions=False)

    def json(self, *args):
        result = self(*args, "--json")
        return result.exit_code, orjson.loads(result.stdout)


@pytest.fixture
def cli() -> Cli:
    return Cli()

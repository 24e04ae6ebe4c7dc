"""The replay tests' fixture: `orch replay` in-process (click's runner)."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner

from replay.cli import replay_command


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

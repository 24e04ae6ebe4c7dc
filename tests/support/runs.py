"""The arguments of `orch run` with the fake env and trainer (and `--set` lists for any run)."""

from __future__ import annotations

from pathlib import Path

FAKE = ("--env", "fake", "--trainer", "fake")


def sets(*assignments: str) -> list[str]:
    """`--set A --set B ...`: one `--set` per `key=value`."""
    return [arg for assignment in assignments for arg in ("--set", assignment)]


def fake_run_args(
    runs_dir: Path | str | None = None, name: str | None = None, *extra: str, steps: int | None = None
) -> list[str]:
    """`run --env fake --trainer fake [--max-steps STEPS] [--runs-dir DIR] [--name NAME] EXTRA...`"""
    args = ["run", *FAKE]
    if steps is not None:
        args += ["--max-steps", str(steps)]
    if runs_dir is not None:
        args += ["--runs-dir", str(runs_dir)]
    if name is not None:
        args += ["--name", name]
    return [*args, *extra]


def run_args(runs_dir: Path | str, *extra: str, name: str = "r", steps: int | None = None) -> list[str]:
    """`run --runs-dir DIR --name NAME [--max-steps STEPS] EXTRA...` (the default env and trainer
    unless EXTRA names others)."""
    args = ["run", "--runs-dir", str(runs_dir), "--name", name]
    if steps is not None:
        args += ["--max-steps", str(steps)]
    return [*args, *extra]

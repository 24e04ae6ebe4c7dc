"""Notices for the user that do not stop the run (shared by the loop, the runner and backends)."""

from __future__ import annotations

import sys


def one_line(text: object) -> str:
    """`text` (an error, a message) on one line: its whitespace runs, newlines too, as one space."""
    return " ".join(str(text).split())


def warn(problem: object) -> None:
    """A problem that does not stop the run, in one line on stderr."""
    print(f"orch: warning: {problem}", file=sys.stderr, flush=True)


def report(line: str) -> None:
    """A line the run reports at its end, on stderr."""
    print(line, file=sys.stderr, flush=True)

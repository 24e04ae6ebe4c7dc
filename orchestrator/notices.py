"""Notices for the user that do not stop the run (shared by the loop, the runner and backends)."""

from __future__ import annotations

import sys


def one_line(text: object) -> str:
    """`text` (an error, a message) on one line: its whitespace runs, newlines too, as one space."""
    return " ".join(str(text).split())


def warn(problem: object) -> None:
    """A problem that does not stop the run, in one line on stderr."""
    print(f"orch: warning: {problem}", file=sys.stderr, flush=True)


def warn_connection_cap(cap: int | None, needed: int, message: str) -> None:
    """Warn `message` (its `{cap}` and `{needed}` filled in) if a connection cap is below the
    `needed` requests the run keeps in flight: the others wait for a free connection."""
    if cap is not None and cap < needed:
        warn(message.format(cap=cap, needed=needed))


def report(line: str) -> None:
    """A line the run reports at its end, on stderr."""
    print(line, file=sys.stderr, flush=True)

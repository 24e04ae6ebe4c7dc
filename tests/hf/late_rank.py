"""`orch trainer` (one torchrun rank of it) whose rank 1 looks at a version's weights only once
the main rank has made them STABLE: the latest a rank can look, made to happen rather than hoped
for (tests/hf/test_distributed.py). Run as ``-m tests.hf.late_rank trainer --run-dir RUN_DIR``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from orchestrator import rundir
from orchestrator.cli import entry

LOOK_BOUND_S = 30  # the most rank 1 waits for the main rank's STABLE before it looks anyway


def looking_late(is_stable: Callable[[str | os.PathLike], bool]) -> Callable[[str | os.PathLike], bool]:
    def late(wdir: str | os.PathLike) -> bool:
        deadline = time.monotonic() + LOOK_BOUND_S
        while not is_stable(wdir) and time.monotonic() < deadline:
            time.sleep(0.01)
        return is_stable(wdir)

    return late


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        rundir.is_stable = looking_late(rundir.is_stable)
    print(f"late_rank: rank {os.environ.get('RANK')}", flush=True)
    entry()

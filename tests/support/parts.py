"""The parts (trainer, backend, algorithm, ...) a run is built of, as the shell builds them."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from orchestrator.shell.compose import RunParts, open_parts
from orchestrator.shell.runner import create_run


def parts_of(config) -> RunParts:
    """The parts a new run of `config` is built of (built, then closed again)."""
    run = create_run(config)

    async def parts() -> RunParts:
        async with AsyncExitStack() as stack:
            return await open_parts(run, stack)

    with run.log:
        return asyncio.run(parts())

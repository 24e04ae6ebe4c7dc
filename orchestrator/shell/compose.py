"""Compose a run: the components its config names, built on one `AsyncExitStack`, and the
loop that runs them, on the event loop of :mod:`.eventloop` (what `orch run` does once
:mod:`.runner` created or resumed the run)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.contracts import Algorithm, InferenceBackend, Trainer
from orchestrator.gc_tuning import tuned_gc
from orchestrator.notices import warn
from orchestrator.observe.sinks import build_feeder
from orchestrator.shell.eventloop import STOP_SIGNALS, held_signals, run_on_new_loop
from orchestrator.shell.loop import Orchestrator
from orchestrator.shell.progress import Progress
from orchestrator.shell.runner import OpenedRun

if TYPE_CHECKING:
    from orchestrator.observe.sinks import SinkFeeder


@dataclass
class RunParts:
    """The components a run is made of, as its config names them (`orchestrator.config`'s registries)."""

    trainer: Trainer
    backend: InferenceBackend
    algorithm: Algorithm
    sinks: SinkFeeder | None  # the metric sinks the config turns on


async def open_parts(run: OpenedRun, stack: AsyncExitStack) -> RunParts:
    """Build the run's components; `stack` closes them at the end, in the reverse order: the
    trainer stops first (cleanly only after a completed run), then the sampler, then the envs,
    then the metric sinks write what the log holds by then."""
    config = run.config
    if run.started_early is not None:  # ended last, if the trainer never started it
        stack.callback(run.started_early.close)
    sinks = build_feeder(config.metrics, run.run_dir, run.log)
    if sinks is not None:
        stack.push_async_callback(lambda: sinks.aclose(run.log.last_seq, warn))
    # The state is the loop's own (evolve updates it in place): its version is the one the run holds.
    ctx = config.build_context(
        run.run_dir, version_now=lambda: run.state.version, model=run.model, started_early=run.started_early
    )
    envs = {}  # those with a task source of their own
    for name, env in config.env_components().items():
        opened = await stack.enter_async_context(env.open(ctx))
        if opened is not None:
            envs[name] = opened
    backend = config.inference_backend().build(ctx, envs)
    stack.push_async_callback(backend.aclose)
    trainer = config.trainer.chosen().build(ctx)

    async def stop_trainer() -> None:
        clean = run.state.stop_reason == "completed"
        await trainer.stop(config.trainer.exit_timeout_s if clean else 0.0)

    stack.push_async_callback(stop_trainer)
    return RunParts(trainer, backend, config.algorithm.chosen().build(ctx), sinks)


def run_job(run: OpenedRun, progress: Progress | None) -> Orchestrator:
    """Run `run` to its end on a new event loop (what `orch run` does).

    A SIGINT/SIGTERM that arrives before the loop's own handlers are installed is kept and
    handled as if it came just after, rather than falling to Python's or asyncio's default
    handler (which abort at once)."""
    with held_signals() as early:
        return run_on_new_loop(run_async(run, progress, early))


async def run_async(run: OpenedRun, progress: Progress | None, early_signals: Sequence[str] = ()) -> Orchestrator:
    with tuned_gc():
        return await _run_async(run, progress, early_signals)


async def _run_async(run: OpenedRun, progress: Progress | None, early_signals: Sequence[str]) -> Orchestrator:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    interrupts = 0
    orch: Orchestrator | None = None
    warm_start: asyncio.Task | None = None

    def on_signal(signame: str) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            print(f"\norch: {signame}: draining and stopping (again to abort)", flush=True)
            if orch is not None:  # else asked for as soon as it is built
                orch.request_stop("interrupted")
            if warm_start is not None:  # no use waiting for weights: the run stops at its first event
                warm_start.cancel()
        else:
            main.cancel()

    # Before the (slow: torch) build; the loop runs the handler at its next await, as it does
    # the signals that came before the loop ran.
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        for signame in early_signals:
            on_signal(signame)
        async with AsyncExitStack() as stack:
            parts = await open_parts(run, stack)
            orch = Orchestrator(
                run.config,
                run.run_dir,
                run.log,
                run.state,
                backend=parts.backend,
                algorithm=parts.algorithm,
                trainer=parts.trainer,
                progress=progress,
                sinks=parts.sinks,
            )
            if interrupts:
                orch.request_stop("interrupted")
            if run.first_input.kind == "run_resumed":
                orch.rematerialize_batches()  # on the loop: it also tells the trainer (not thread-safe)
                orch.remove_trained_batches()  # those a stop left behind before it removed them
                orch.drop_unneeded_token_arrays()  # likewise, and all of them when the setting was keep
            await parts.trainer.start()
            if parts.backend.follows_weights and not interrupts:
                # Version 0 is the trainer's warm start; the run resumes from the newest version.
                warm_start = waiting = loop.create_task(
                    parts.backend.load(run.state.version, health_check=parts.trainer.check)
                )
                try:
                    await waiting
                except asyncio.CancelledError:
                    if main.cancelling() or not waiting.cancelled():
                        raise
                    # Cancelled by an interrupt: the stop it requested ends the run at its first event.
                warm_start = None
            await orch.run(run.first_input)
            return orch
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)

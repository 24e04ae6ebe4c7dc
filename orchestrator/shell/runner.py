"""Compose a run: the run directory, its log, the components its config names, and the loop;
create or resume."""

from __future__ import annotations

import asyncio
import re
import signal
import tempfile
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from eventlog import EventLog, LogExistsError, LogNotFoundError
from orchestrator.components import Algorithm, BuildContext, InferenceBackend, Trainer
from orchestrator.config import ConfigError, RunConfig, config_hash, load_config, meaning_changes, with_added_fields
from orchestrator.core import events as ev
from orchestrator.core.state import State, initial_state
from orchestrator.fold import fold_log
from orchestrator.gc_tuning import tuned_gc
from orchestrator.notices import warn
from orchestrator.observe.sinks import build_feeder
from orchestrator.rundir import EVENTS_DB, batch_steps_on_disk, batches_dir, events_db
from orchestrator.shell.loop import Orchestrator
from orchestrator.shell.progress import Progress

if TYPE_CHECKING:
    from orchestrator.hf.model import PreparedModel
    from orchestrator.observe.sinks import SinkFeeder

LOG_MAGIC_META = {"app": "orch", "schema_version": str(ev.EVENT_SCHEMA_VERSION)}


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; one-line message."""


@dataclass
class OpenedRun:
    config: RunConfig
    run_dir: Path
    log: EventLog
    state: State
    first_input: object
    resumed_from: int | None
    model: PreparedModel | None = None  # the hf trainer's model dir, checked and hashed


MODEL_HASH_META = "model_sha256"


def prepare_model(config: RunConfig, stored_hash: str | None = None) -> PreparedModel | None:
    """The trainer's model dir (if it trains one), checked by the trainer and by the inference
    backend that samples it, before anything runs (ConfigError: one line)."""
    model = config.trainer.chosen().prepare_model(config, stored_hash)
    if model is not None:
        config.inference_backend().check_model(config, model.path.resolve())
    return model


_RUN_NAME = re.compile(r"[A-Za-z0-9_+=@][A-Za-z0-9._+=@-]{0,199}")


def create_run(config: RunConfig) -> OpenedRun:
    if not _RUN_NAME.fullmatch(config.name):  # one directory under runs_dir, safe to paste in a shell
        raise ConfigError(
            f"invalid run name {config.name!r}: letters, digits and ._+=@- only, not starting with "
            "'.' or '-', at most 200 characters"
        )
    run_dir = config.run_dir
    db = events_db(run_dir)
    if db.exists():
        raise RunDirError(
            f"{run_dir} already holds a run; continue it with `orch run --resume {run_dir}` or pick another --name"
        )
    _check_runs_dir(config.runs_dir)
    model = prepare_model(config)  # before the run dir exists: a bad model leaves nothing behind
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
    config_json = config.to_json()
    model_meta = {} if model is None else {MODEL_HASH_META: model.sha256}
    try:
        log = EventLog.create(
            db,
            meta={
                **LOG_MAGIC_META,
                "config": config_json.decode(),
                "config_hash": config_hash(config_json),
                "seed": str(config.seed),
                **model_meta,
            },
            durability=config.log.durability,
        )
    except LogExistsError as err:
        raise RunDirError(str(err)) from None
    params = config.core_params()
    return OpenedRun(config, run_dir, log, initial_state(params), ev.RunStarted(params=params), None, model)


def _check_runs_dir(runs_dir: Path) -> None:
    """runs_dir exists (made if not) and takes files: found out now, in one line, not as an
    OSError from whatever writes there first (the model cache, the run dir)."""
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=runs_dir).close()  # a real probe: permission bits say little to root
    except OSError as err:
        raise RunDirError(f"cannot write in the runs dir {runs_dir}: {err.strerror or err}") from None


def resume_run(run_dir: Path, overrides: list[str], config_file: Path | None = None) -> OpenedRun:
    db = events_db(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"cannot resume {run_dir}: no such run directory")
    if not db.exists():
        raise RunDirError(f"cannot resume {run_dir}: it holds no {EVENTS_DB}")
    stored, stored_model_hash = _stored_config(db)
    requested = _requested_config(stored, run_dir, overrides, config_file)
    model = prepare_model(requested, stored_model_hash)
    try:  # with the durability asked for now (an operational field a resume may change)
        log = EventLog.open(db, durability=requested.log.durability)
    except LogNotFoundError as err:
        raise RunDirError(str(err)) from None
    if log.damaged_copy is not None:
        warn(
            f"{db}'s snapshots were damaged (its events are intact): rebuilt without them; "
            f"the damaged file is {log.damaged_copy}"
        )
    try:
        with tuned_gc():
            folded = fold_log(log)
        if folded.state is None:  # it stopped before its first event was committed
            params = requested.core_params()
            return OpenedRun(requested, run_dir, log, initial_state(params), ev.RunStarted(params=params), None, model)
        # max_steps defaults to the run's current one (a resume may have raised it), not to the
        # one it was created with.
        requested = _requested_config(stored, run_dir, overrides, config_file, max_steps=folded.state.params.max_steps)
        shipped = folded.state.step - 1
        _check_no_batch_file_beyond(run_dir, shipped)
        if requested.max_steps < shipped:  # the trainer (told max_steps) would never train them all
            raise ConfigError(
                f"max_steps {requested.max_steps} is below the {shipped} batches {run_dir} already "
                f"shipped; resume with --max-steps {shipped} or more"
            )
        _check_not_complete(run_dir, folded.state, requested.max_steps)
        requested.trainer.chosen().check_resume(run_dir, folded.state.version)
        first = ev.RunResumed(from_seq=folded.seq, max_steps=requested.max_steps)
        return OpenedRun(requested, run_dir, log, folded.state, first, folded.seq, model)
    except BaseException:
        log.close()
        raise


def _check_not_complete(run_dir: Path, state: State, max_steps: int) -> None:
    """A completed run resumed without a higher max_steps would start its components only to stop
    at once, appending a resume and a stop: refused instead, with nothing appended."""
    shipped = state.step - 1
    if state.stop_reason == "completed" and max_steps <= shipped:
        raise RunDirError(
            f"{run_dir} is complete at step {shipped}; pass --max-steps {shipped + 1} or more to continue it"
        )


def _check_no_batch_file_beyond(run_dir: Path, shipped: int) -> None:
    """A batch file is written only after its batch_shipped event is committed, so one past the
    log's last shipped step means the log lost committed events (a deleted or damaged -wal file).
    Refused rather than overwritten: the trainer may have trained on it."""
    beyond = sorted(step for step in batch_steps_on_disk(run_dir) if step > shipped)
    if beyond:
        raise RunDirError(
            f"{batches_dir(run_dir)} holds batch files for steps {beyond[0]}..{beyond[-1]}, but the log "
            f"shipped only up to step {shipped}: it lost committed events (its -wal file deleted or "
            "damaged?); move those files away to resume from the log as it is"
        )


def _stored_config(db: Path) -> tuple[RunConfig, str | None]:
    """The config the run was created with and its model's hash, from the log's meta table."""
    try:
        with EventLog.open_reader(db) as reader:
            meta = reader.meta
    except LogNotFoundError as err:
        raise RunDirError(str(err)) from None
    if meta.get("app") != "orch" or "config" not in meta:
        raise RunDirError(f"{db} is an event log, but not one written by `orch run`")
    try:  # its events' format, before its config (which may not load for the same reason)
        ev.check_schema_version(meta.get("schema_version", "(none)"))
    except ValueError as err:
        raise RunDirError(f"{db}: {err}") from None
    try:
        stored_json = orjson.loads(meta["config"])
    except orjson.JSONDecodeError:
        stored_json = None
    if not isinstance(stored_json, dict):
        raise RunDirError(f"{db} is corrupted: the run's stored config is not a JSON object")
    try:
        return load_config(base=with_added_fields(stored_json)), meta.get(MODEL_HASH_META)
    except ConfigError as err:
        raise RunDirError(f"{db}: the run's stored config does not load with this orch: {err}") from None


def _requested_config(
    stored: RunConfig, run_dir: Path, overrides: list[str], config_file: Path | None, max_steps: int | None = None
) -> RunConfig:
    """The stored config (with `max_steps`, the run's current one, if given) with the overrides
    applied; ConfigError if they change its meaning."""
    base = stored.model_dump(mode="json") | ({} if max_steps is None else {"max_steps": max_steps})
    requested = load_config(config_file, overrides, base=base)
    requested = requested.model_copy(update={"runs_dir": run_dir.parent, "name": run_dir.name})
    changed = meaning_changes(stored, requested)
    if changed:
        raise ConfigError(
            f"config changed on resume in fields that alter the run: {', '.join(changed)} "
            "(only max_steps and operational fields may change)"
        )
    return requested


@dataclass
class RunParts:
    """The components a run is made of, as its config names them (`orchestrator.components`)."""

    trainer: Trainer
    backend: InferenceBackend
    algorithm: Algorithm
    sinks: SinkFeeder | None  # the metric sinks the config turns on


async def open_parts(run: OpenedRun, stack: AsyncExitStack) -> RunParts:
    """Build the run's components; `stack` closes them at the end, in the reverse order: the
    trainer stops first (cleanly only after a completed run), then the sampler, then the envs,
    then the metric sinks write what the log holds by then."""
    config = run.config
    sinks = build_feeder(config.metrics, run.run_dir, run.log)
    if sinks is not None:
        stack.push_async_callback(lambda: sinks.aclose(run.log.last_seq, warn))
    # The state is the loop's own (evolve updates it in place): its version is the one the run holds.
    ctx = BuildContext(config, run.run_dir, version_now=lambda: run.state.version, model=run.model)
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


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (Linux, macOS): its task and callback machinery gives the
    loop more episodes/s (measured by bench/test_core_bench.py); asyncio's own loop elsewhere."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


LEFTOVER_WAIT_S = 10.0  # at exit, the longest wait for tasks cancelled because they outlived the run


def run_on_new_loop(coro):
    """Run `coro` with `asyncio.Runner` on the event loop `orch run` uses (`new_event_loop`), with
    a bounded close. The Runner's own close cancels the tasks still running when `coro` ends and
    waits for them without a bound: a task that ignores its cancellation (a rollout swallowing
    CancelledError) would hang the exit forever. So they are cancelled first here, waited for at
    most LEFTOVER_WAIT_S, then named on stderr and abandoned with the loop; the wait for worker
    threads is bounded the same way. Only a loop left with nothing running is closed by the Runner."""
    runner = asyncio.Runner(loop_factory=new_event_loop)
    try:
        return runner.run(coro)
    finally:
        loop = runner.get_loop()
        if runner.run(_close_leftovers(LEFTOVER_WAIT_S)):
            runner.close()
        else:
            loop.close()


async def _close_leftovers(timeout_s: float) -> bool:
    """Cancel the tasks left running, wait for them and for the worker threads (each at most
    `timeout_s`); True if nothing is left, else what is left was named in a warning."""
    tasks_done = await _cancel_leftover_tasks(timeout_s)
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    return await _shutdown_default_executor(loop, timeout_s) and tasks_done


async def _shutdown_default_executor(loop: asyncio.AbstractEventLoop, timeout_s: float) -> bool:
    """Join the `to_thread` workers, waiting at most `timeout_s`. A thread cannot be cancelled:
    one still busy is named in a warning, and Python joins it again at interpreter exit."""
    try:
        await asyncio.wait_for(loop.shutdown_default_executor(), timeout_s)
    except TimeoutError:
        warn(
            f"a worker thread (log commit, file write) was still busy {timeout_s:g}s after the run ended; "
            "the process exits once it returns"
        )
        return False
    return True


async def _cancel_leftover_tasks(timeout_s: float) -> bool:
    leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in leftovers:
        task.cancel()
    if not leftovers:
        return True
    _, stuck = await asyncio.wait(leftovers, timeout=timeout_s)
    loop = asyncio.get_running_loop()
    for task in leftovers:  # an error on the way out is reported, as asyncio.run reports it
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {"message": "unhandled exception during orch shutdown", "exception": task.exception(), "task": task}
            )
    if not stuck:
        return True
    names = sorted(task.get_name() for task in stuck)
    _quiet_about_destroying(loop, frozenset(names))
    warn(f"{len(stuck)} task(s) still running {timeout_s:g}s after cancellation at exit, abandoned: {', '.join(names)}")
    return False


def _quiet_about_destroying(loop: asyncio.AbstractEventLoop, abandoned: frozenset[str]) -> None:
    """Named in a warning already: asyncio would report each again when it is destroyed pending
    (with a traceback). By name, so the handler holds no reference that keeps them alive."""
    report = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        task = context.get("task")
        if (
            task is not None
            and task.get_name() in abandoned
            and context.get("message", "").startswith("Task was destroyed but it is pending")
        ):
            return
        if report is not None:
            report(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_job(run: OpenedRun, progress: Progress | None) -> Orchestrator:
    """Run `run` to its end on a new event loop (what `orch run` does).

    A SIGINT/SIGTERM that arrives before the loop's own handlers are installed is kept and
    handled as if it came just after, rather than falling to Python's or asyncio's default
    handler (which abort at once)."""
    early: list[str] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: early.append(signal.Signals(signum).name))
        for sig in _STOP_SIGNALS
    }
    try:
        return run_on_new_loop(run_async(run, progress, early))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    for sig in _STOP_SIGNALS:
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
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)

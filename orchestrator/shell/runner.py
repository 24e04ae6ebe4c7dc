"""Compose a run: the run directory, its log, the backends, and the loop; create or resume."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from eventlog import EventLog, LogExistsError, LogNotFoundError
from orchestrator.config import ConfigError, RunConfig, config_hash, load_config, meaning_changes, with_added_fields
from orchestrator.core import events as ev
from orchestrator.core.state import State, initial_state
from orchestrator.rundir import batch_steps_on_disk, batches_dir
from orchestrator.gc_tuning import tuned_gc
from orchestrator.observe.sinks import build_feeder
from orchestrator.shell.algorithms import make_algorithm
from orchestrator.shell.loop import LoopHooks, Orchestrator, warn
from orchestrator.shell.progress import Progress
from orchestrator.shell.rollouts import EmbeddedRollouts, FakeEnvRollouts
from orchestrator.shell.trainers import FakeTrainer, ProcessTrainer, TrainerFailed
from orchestrator.fold import fold_log

EVENTS_DB = "events.db"
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


_RUN_NAME = re.compile(r"[A-Za-z0-9_+=@][A-Za-z0-9._+=@-]{0,199}")


def create_run(config: RunConfig) -> OpenedRun:
    if not _RUN_NAME.fullmatch(config.name):  # one directory under runs_dir, safe to paste in a shell
        raise ConfigError(f"invalid run name {config.name!r}: letters, digits and ._+=@- only, not starting with "
                          "'.' or '-', at most 200 characters")
    run_dir = config.run_dir
    db = run_dir / EVENTS_DB
    if db.exists():
        raise RunDirError(f"{run_dir} already holds a run; continue it with `orch run --resume {run_dir}` or pick another --name")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
    config_json = config.to_json()
    try:
        log = EventLog.create(db, meta={**LOG_MAGIC_META, "config": config_json.decode(),
                                        "config_hash": config_hash(config_json), "seed": str(config.seed)},
                              durability=config.log.durability)
    except LogExistsError as err:
        raise RunDirError(str(err)) from None
    params = config.core_params()
    return OpenedRun(config, run_dir, log, initial_state(params), ev.RunStarted(params=params), None)


def resume_run(run_dir: Path, overrides: list[str], config_file: Path | None = None) -> OpenedRun:
    db = run_dir / EVENTS_DB
    if not run_dir.is_dir():
        raise RunDirError(f"cannot resume {run_dir}: no such run directory")
    if not db.exists():
        raise RunDirError(f"cannot resume {run_dir}: it holds no {EVENTS_DB}")
    stored = _stored_config(db)
    requested = _requested_config(stored, run_dir, overrides, config_file)
    try:  # with the durability asked for now (an operational field a resume may change)
        log = EventLog.open(db, durability=requested.log.durability)
    except LogNotFoundError as err:
        raise RunDirError(str(err)) from None
    try:
        with tuned_gc():
            folded = fold_log(log)
        if folded.state is None:  # it stopped before its first event was committed
            params = requested.core_params()
            return OpenedRun(requested, run_dir, log, initial_state(params), ev.RunStarted(params=params), None)
        # max_steps defaults to the run's current one (a resume may have raised it), not to the
        # one it was created with.
        requested = _requested_config(stored, run_dir, overrides, config_file, max_steps=folded.state.params.max_steps)
        shipped = folded.state.step - 1
        _check_no_batch_file_beyond(run_dir, shipped)
        if requested.max_steps < shipped:  # the trainer (told max_steps) would never train them all
            raise ConfigError(f"max_steps {requested.max_steps} is below the {shipped} batches {run_dir} already "
                              f"shipped; resume with --max-steps {shipped} or more")
        first = ev.RunResumed(from_seq=folded.seq, max_steps=requested.max_steps)
        return OpenedRun(requested, run_dir, log, folded.state, first, folded.seq)
    except BaseException:
        log.close()
        raise


def _check_no_batch_file_beyond(run_dir: Path, shipped: int) -> None:
    """A batch file is written only after its batch_shipped event is committed, so one past the
    log's last shipped step means the log lost committed events (a deleted or damaged -wal file).
    Refused rather than overwritten: the trainer may have trained on it."""
    beyond = sorted(step for step in batch_steps_on_disk(run_dir) if step > shipped)
    if beyond:
        raise RunDirError(f"{batches_dir(run_dir)} holds batch files for steps {beyond[0]}..{beyond[-1]}, but the log "
                          f"shipped only up to step {shipped}: it lost committed events (its -wal file deleted or "
                          "damaged?); move those files away to resume from the log as it is")


def _stored_config(db: Path) -> RunConfig:
    """The config the run was created with, from the log's meta table."""
    try:
        with EventLog.open_reader(db) as reader:
            meta = reader.meta
    except LogNotFoundError as err:
        raise RunDirError(str(err)) from None
    if meta.get("app") != "orch" or "config" not in meta:
        raise RunDirError(f"{db} is an event log, but not one written by `orch run`")
    try:
        stored_json = orjson.loads(meta["config"])
    except orjson.JSONDecodeError:
        stored_json = None
    if not isinstance(stored_json, dict):
        raise RunDirError(f"{db} is corrupted: the run's stored config is not a JSON object")
    try:
        return load_config(base=with_added_fields(stored_json))
    except ConfigError as err:
        raise RunDirError(f"{db}: the run's stored config does not load with this orch: {err}") from None


def _requested_config(stored: RunConfig, run_dir: Path, overrides: list[str], config_file: Path | None,
                      max_steps: int | None = None) -> RunConfig:
    """The stored config (with `max_steps`, the run's current one, if given) with the overrides
    applied; ConfigError if they change its meaning."""
    base = stored.model_dump(mode="json") | ({} if max_steps is None else {"max_steps": max_steps})
    requested = load_config(config_file, overrides, base=base)
    requested = requested.model_copy(update={"runs_dir": run_dir.parent, "name": run_dir.name})
    changed = meaning_changes(stored, requested)
    if changed:
        raise ConfigError(f"config changed on resume in fields that alter the run: {', '.join(changed)} (only max_steps and operational fields may change)")
    return requested


def write_embedded_trainer_config(config: RunConfig, run_dir: Path) -> None:
    from orchestrator.embedded.defaults import KEEP_WEIGHTS as DEFAULT_KEEP_WEIGHTS
    from orchestrator.embedded.trainer import TrainerConfig, write_trainer_config

    config_for_trainer = TrainerConfig(
        max_steps=config.max_steps, lr=config.trainer.lr, seed=config.seed,
        sft_steps=config.trainer.sft_steps, env_min_len=config.reverse_text.min_len,
        env_max_len=config.reverse_text.max_len, temperature=config.rollout.temperature,
        max_new_tokens=config.rollout.max_new_tokens,
        batch_wait_timeout_s=config.trainer.publish_timeout_s, parent_pid=os.getpid(),
        # The trainer may publish up to target_lag + 1 versions the log has not recorded yet (a
        # crash); a resume reloads the newest recorded one, which must still be on disk.
        keep_weights=max(DEFAULT_KEEP_WEIGHTS, config.off_policy.target_lag + 2),
    )
    try:
        write_trainer_config(run_dir, config_for_trainer)
    except OSError as err:  # e.g. a directory in its place: one line, like the trainer's own failures
        raise TrainerFailed(f"cannot write the trainer's config in {run_dir}: {err.strerror or err}") from err


def build_orchestrator(run: OpenedRun, progress: Progress | None) -> Orchestrator:
    config, run_dir = run.config, run.run_dir
    holder: dict[str, Orchestrator] = {}

    def publish(version: int, metrics: dict | None) -> None:
        holder["orch"].publish_version(version, metrics)

    def version_now() -> int:
        return holder["orch"].state.version

    on_version = None
    if config.trainer.kind == "fake":
        trainer = FakeTrainer(run_dir, config.trainer.step_time_s, publish)
    else:
        write_embedded_trainer_config(config, run_dir)
        if config.trainer.nproc > 1:  # DDP under torchrun, supervised the same way
            from orchestrator.shell.torchrun_trainer import TorchrunTrainer

            trainer = TorchrunTrainer(run_dir, publish, config.trainer.nproc, config.trainer.ddp_backend)
        else:
            trainer = ProcessTrainer(run_dir, publish)
    if set(config.envs) == {"fake"}:
        rollout = FakeEnvRollouts(config.fake_env, config.seed, version_now)
    elif set(config.envs) == {"verifiers"}:  # a verifiers taskset, sampled through the endpoints
        from orchestrator.envs.verifiers import VerifiersRollouts

        rollout = VerifiersRollouts(run_dir, config.verifiers, _inference_client(config), seed=config.seed,
                                    temperature=config.rollout.temperature,
                                    max_tokens=config.rollout.max_new_tokens,
                                    load_timeout_s=config.trainer.publish_timeout_s)
        on_version = rollout.load
    else:
        env = _rollout_env(config)
        if config.inference.endpoints:  # OpenAI-compatible servers (orch serve, vLLM, SGLang)
            from orchestrator.inference.rollouts import InferenceRollouts

            client = _inference_client(config)
            rollout = InferenceRollouts(run_dir, env, client, temperature=config.rollout.temperature,
                                        max_new_tokens=config.rollout.max_new_tokens, seed=config.seed,
                                        load_timeout_s=config.trainer.publish_timeout_s)
        else:
            rollout = EmbeddedRollouts(run_dir, env, temperature=config.rollout.temperature,
                                       max_new_tokens=config.rollout.max_new_tokens, seed=config.seed,
                                       load_timeout_s=config.trainer.publish_timeout_s)
        on_version = rollout.load
    orch = Orchestrator(config, run_dir, run.log, run.state, hooks=LoopHooks(rollout, on_version),
                        algorithm=make_algorithm(config), trainer=trainer, progress=progress,
                        sinks=build_feeder(config.metrics, run_dir, run.log))
    holder["orch"] = orch
    return orch


def _inference_client(config: RunConfig):
    from orchestrator.inference.client import InferenceClient

    inf = config.inference
    return InferenceClient(inf.endpoints, model=inf.model, weight_sync=inf.weight_sync,
                           timeout_s=inf.request_timeout_s, load_timeout_s=config.trainer.publish_timeout_s,
                           max_attempts=inf.max_attempts, backoff_s=inf.backoff_s,
                           max_backoff_s=inf.max_backoff_s, pin_groups=inf.pin_groups)


def _rollout_env(config: RunConfig):
    """The reverse_text env the rollout workers call: in this process, or behind the
    `orch env-server` at `rollout.env_server` (checked by `_check_env_server` before the run)."""
    if config.rollout.env_server is not None:
        from orchestrator.rollouts.env_client import HttpEnvClient

        return HttpEnvClient(config.rollout.env_server)
    from orchestrator.envs.base import InProcessEnv
    from orchestrator.envs.reverse_text import ReverseTextEnv

    return InProcessEnv(ReverseTextEnv(seed=config.seed, min_len=config.reverse_text.min_len,
                                       max_len=config.reverse_text.max_len))


def _env_client_of(rollout):
    """The env server client the rollout workers use, if any (closed by the runner at the end)."""
    module = sys.modules.get("orchestrator.rollouts.env_client")
    env = getattr(rollout, "env", None)
    return env if module is not None and isinstance(env, module.HttpEnvClient) else None


async def _check_env_server(client, config: RunConfig) -> None:
    """Fail before the run, in one line, if the env server is unreachable or does not serve the
    tasks this run asks for (reverse_text, with the run's seed and prompt lengths)."""
    from orchestrator.rollouts.env_client import EnvServerError

    health = await client.health()
    served = health.get("env") if isinstance(health, dict) else None
    if served != "reverse_text":
        raise EnvServerError(f"{client.base_url} serves env {served!r}, not 'reverse_text'")
    wanted = {"seed": config.seed, "min_len": config.reverse_text.min_len, "max_len": config.reverse_text.max_len}
    if health.get("params") != wanted:
        raise EnvServerError(f"{client.base_url} serves reverse_text tasks of {health.get('params')}, this run's are "
                             f"{wanted}: start it with --seed {config.seed} --min-len {wanted['min_len']} "
                             f"--max-len {wanted['max_len']}")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (Linux, macOS): its task and callback machinery gives the
    loop 15-30% more episodes/s (bench/test_core_bench.py); asyncio's own loop elsewhere."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


LEFTOVER_WAIT_S = 10.0  # at exit, the longest wait for tasks cancelled because they outlived the run


def run_on_new_loop(coro):
    """`asyncio.run(coro)` on the event loop `orch run` uses (`new_event_loop`), with a bounded
    close. asyncio.run cancels the tasks still running when `coro` ends and then waits for them
    without a bound: a task that ignores its cancellation (a rollout swallowing CancelledError)
    would hang the exit forever. Here they are waited for at most LEFTOVER_WAIT_S, then named on
    stderr and abandoned with the loop; the wait for worker threads is bounded the same way."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(_cancel_leftover_tasks(LEFTOVER_WAIT_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(_shutdown_default_executor(loop, LEFTOVER_WAIT_S))
        finally:
            loop.close()


async def _shutdown_default_executor(loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
    """Join the `to_thread` workers, waiting at most `timeout_s`. A thread cannot be cancelled:
    one still busy is named in a warning, and Python joins it again at interpreter exit."""
    try:
        await asyncio.wait_for(loop.shutdown_default_executor(), timeout_s)
    except TimeoutError:
        warn(f"a worker thread (log commit, file write) was still busy {timeout_s:g}s after the run ended; "
             "the process exits once it returns")


async def _cancel_leftover_tasks(timeout_s: float) -> None:
    leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in leftovers:
        task.cancel()
    if not leftovers:
        return
    _, stuck = await asyncio.wait(leftovers, timeout=timeout_s)
    loop = asyncio.get_running_loop()
    for task in leftovers:  # an error on the way out is reported, as asyncio.run reports it
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception during orch shutdown",
                                         "exception": task.exception(), "task": task})
    if stuck:
        for task in stuck:
            task._log_destroy_pending = False  # named just below; asyncio would add a traceback each
        names = ", ".join(sorted(task.get_name() for task in stuck))
        warn(f"{len(stuck)} task(s) still running {timeout_s:g}s after cancellation at exit, abandoned: {names}")


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_job(run: OpenedRun, progress: Progress | None) -> Orchestrator:
    """Run `run` to its end on a new event loop (what `orch run` does).

    A SIGINT/SIGTERM that arrives before the loop's own handlers are installed is kept and
    handled as if it came just after, rather than falling to Python's or asyncio's default
    handler (which abort at once)."""
    early: list[str] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: early.append(signal.Signals(signum).name))
                for sig in _STOP_SIGNALS}
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
    warm_start: asyncio.Task | None = None

    def on_signal(signame: str) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            print(f"\norch: {signame}: draining and stopping (again to abort)", flush=True)
            orch.request_stop("interrupted")
            if warm_start is not None:  # no use waiting for weights: the run stops at its first event
                warm_start.cancel()
        else:
            main.cancel()

    # Before the (slow: torch) build; the loop runs the handler at its next await, after the
    # build, as it does the signals that came before the loop ran.
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        orch = build_orchestrator(run, progress)
        for signame in list(early_signals):
            on_signal(signame)
        trainer = orch.trainer
        env_client = _env_client_of(orch.hooks.rollout)
        try:
            if env_client is not None:
                await _check_env_server(env_client, run.config)
            if hasattr(orch.hooks.rollout, "start"):  # VerifiersRollouts: verifiers' serving resources
                await orch.hooks.rollout.start()
            if run.first_input.kind == "run_resumed":
                orch.rematerialize_batches()  # on the loop: it also tells the trainer (not thread-safe)
            if isinstance(trainer, ProcessTrainer):
                trainer.start()
            if orch.hooks.on_version is not None and not interrupts:  # EmbeddedRollouts or InferenceRollouts
                # Version 0 is the trainer's warm start; the run resumes from the newest version.
                warm_start = loop.create_task(orch.hooks.on_version(run.state.version, health_check=trainer.check))
                try:
                    await warm_start
                except asyncio.CancelledError:
                    if main.cancelling() or not warm_start.cancelled():
                        raise
                    # Cancelled by an interrupt: the stop it requested ends the run at its first event.
                warm_start = None
            await orch.run(run.first_input)
            return orch
        finally:
            clean = orch.state.stop_reason == "completed"
            await trainer.stop(run.config.trainer.exit_timeout_s if clean else 0.0)
            if hasattr(orch.hooks.rollout, "aclose"):  # InferenceRollouts: endpoint report, HTTP client
                print(orch.hooks.rollout.report(), file=sys.stderr, flush=True)
                await orch.hooks.rollout.aclose()
            if isinstance(orch.hooks.rollout, EmbeddedRollouts):
                await asyncio.to_thread(orch.hooks.rollout.close)
            if env_client is not None:
                await env_client.aclose()
            if orch.sinks is not None:
                await orch.sinks.aclose(run.log.last_seq, warn)
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)

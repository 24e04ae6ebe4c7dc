"""Create or resume a run: its directory, its log (checked as `orchestrator.orch_log` says), its
config (stored, and what a resume may change) and its model, checked before anything runs. The
run's components are composed by :mod:`.compose`, on the event loop of :mod:`.eventloop`."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from eventlog import EventLog, LogError, LogExistsError, LogNotFoundError
from orchestrator.config import (
    ConfigError,
    RunConfig,
    config_hash,
    load_config,
    meaning_changes,
)
from orchestrator.core import events as ev
from orchestrator.core.state import State, initial_state
from orchestrator.fold import Folded, fold_log
from orchestrator.gc_tuning import tuned_gc
from orchestrator.notices import warn
from orchestrator.observe.sinks import check_sinks
from orchestrator.orch_log import LOG_MAGIC_META, OrchLogError, open_orch_log, warn_if_unchecked
from orchestrator.rundir import EVENTS_DB, batch_steps_on_disk, batches_dir, events_db

if TYPE_CHECKING:
    from orchestrator.contracts import PreparedModel, StartedEarly


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
    started_early: StartedEarly | None = None  # the trainer's, overlapping the checks (the run closes it)


MODEL_HASH_META = "model_sha256"


def check_outside(config: RunConfig) -> None:
    """The quick pre-run steps, before the run dir (and the runs dir) exist and before the model is
    built, so that a mistake is told in seconds (ConfigError, SinkUnavailable: one line): the
    metric sinks' packages and credentials, each env's (its server and seed), the inference
    backend's given servers (reachable, and able to load what the trainer publishes)."""
    check_sinks(config.metrics)
    config.placement_of()  # SLURM's: srun there, inside an allocation that has the layout's nodes
    for env in config.env_components().values():
        env.preflight(config.seed)
    trainer = config.trainer.chosen()
    config.inference_backend().preflight_servers(trainer.weight_format if trainer.writes_weights else None)


def preflight(config: RunConfig, stored_hash: str | None = None) -> PreparedModel | None:
    """The pre-run steps that need the model, before the run dir exists (ConfigError: one line):
    the trainer's model dir (if it trains one: building the default model is slow), checked by
    the trainer and by the inference backend that samples it."""
    model = config.trainer.chosen().prepare_model(config.model_request(), stored_hash)
    if model is not None:
        config.inference_backend().preflight(model.path.resolve())
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
    check_outside(config)
    _check_runs_dir(config.runs_dir)
    # only a local trainer starts before the run is built (a placed one starts as its job step)
    started_early = config.trainer.chosen().start_early(run_dir) if config.placement == "local" else None
    try:
        model = preflight(config)  # before the run dir exists: a bad model leaves nothing behind
        log = _create_log(config, model)
    except BaseException:
        _close(started_early)
        raise
    params = config.core_params()
    return OpenedRun(
        config, run_dir, log, initial_state(params), ev.RunStarted(params=params), None, model, started_early
    )


def _create_log(config: RunConfig, model: PreparedModel | None) -> EventLog:
    """The run directory and its log, the run's config and model hash in the log's meta."""
    try:
        config.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {config.run_dir}: {err.strerror}") from None
    config_json = config.to_json()
    model_meta = {} if model is None else {MODEL_HASH_META: model.sha256}
    try:
        return EventLog.create(
            events_db(config.run_dir),
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


def _close(started_early: StartedEarly | None) -> None:
    """What the trainer started early, closed when the run does not start after all."""
    if started_early is not None:
        started_early.close()


def _check_runs_dir(runs_dir: Path) -> None:
    """runs_dir exists (made if not) and takes files: found out now, in one line, not as an
    OSError from whatever writes there first (the model cache, the run dir)."""
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=runs_dir).close()  # a real probe: permission bits say little to root
    except OSError as err:
        raise RunDirError(f"cannot write in the runs dir {runs_dir}: {err.strerror or err}") from None


def resume_run(
    run_dir: Path, overrides: list[str], config_file: Path | None = None, drop_damaged: bool = False
) -> OpenedRun:
    db = events_db(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"cannot resume {run_dir}: no such run directory")
    if not db.exists():
        raise RunDirError(f"cannot resume {run_dir}: it holds no {EVENTS_DB}")
    stored, stored_model_hash = _stored_config(db)
    requested = _requested_config(stored, run_dir, overrides, config_file)
    check_outside(requested)
    started_early = requested.trainer.chosen().start_early(run_dir)
    try:
        run = _resume(run_dir, db, stored, stored_model_hash, requested, overrides, config_file, drop_damaged)
    except BaseException:
        _close(started_early)
        raise
    run.started_early = started_early
    return run


def _resume(
    run_dir: Path,
    db: Path,
    stored: RunConfig,
    stored_model_hash: str | None,
    requested: RunConfig,
    overrides: list[str],
    config_file: Path | None,
    drop_damaged: bool,
) -> OpenedRun:
    """`resume_run` from the model's checks on, while the trainer started early imports."""
    model = preflight(requested, stored_model_hash)
    try:  # with the durability asked for now (an operational field a resume may change)
        log = EventLog.open(db, durability=requested.log.durability)
    except LogNotFoundError as err:
        raise RunDirError(str(err)) from None
    if log.damaged_copy is not None:
        warn(
            f"{db}'s snapshots were damaged (its events are intact): rebuilt without them; "
            f"the damaged file is {log.damaged_copy}"
        )
    warn_if_unchecked(log, db)
    try:
        with tuned_gc():
            folded = fold_log(log, keep_damaged=True)
        damaged, dropping = _damaged_traces(run_dir, folded, drop_damaged)
        _check_other_rows(log, folded)
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
        if dropping:
            warn(dropping)
        first = ev.RunResumed(from_seq=folded.seq, max_steps=requested.max_steps, damaged_traces=damaged)
        return OpenedRun(requested, run_dir, log, folded.state, first, folded.seq, model)
    except BaseException:
        log.close()
        raise


def _damaged_traces(run_dir: Path, folded: Folded, drop_damaged: bool) -> tuple[list[int], str | None]:
    """The held traces, never shipped, whose payloads are lost: refused in one line naming the
    first and the flag, or with `--drop-damaged` returned with the line that says so, for the
    resume to drop them as logged events (docs/resume.md)."""
    if not folded.damaged:
        return [], None
    lost = sorted(folded.damaged.items(), key=lambda item: item[1][0])
    _first_id, (_seq, why) = lost[0]
    seqs = ", ".join(str(seq) for _trace_id, (seq, _why) in lost[:5]) + (", ..." if len(lost) > 5 else "")
    what = f"{len(lost)} trace{'s' if len(lost) > 1 else ''} never shipped (seq {seqs})"
    if not drop_damaged:
        raise RunDirError(
            f"{why}; {what} lost their payloads: `orch run --resume {run_dir} --drop-damaged` drops them "
            "(logged, shipped history untouched) and continues, or restore the payload files from a copy"
        )
    dropping = f"dropping {what} whose payloads are lost (--drop-damaged); first: {why}"
    return sorted(trace_id for trace_id, _where in lost), dropping


def _check_other_rows(log: EventLog, folded: Folded) -> None:
    """Refuse a log with a damaged payload row that is not a held trace's (a trace shipped or
    dropped: history), before anything is appended: a writer does not append onto damage, as it
    does not onto a file that fails SQLite's quick_check. Every row with a payload is checked (the
    rows without one are checked as `orch replay` reads them: a resume time that grew with every
    event logged would be too dear). A held trace's damaged row is `_damaged_traces`' (the fold
    reads it; --drop-damaged drops it)."""
    held = {seq for seq, _why in folded.damaged.values()}
    damaged = log.damaged_rows(folded.seq, payloads_only=True)
    other = {seq: why for seq, why in damaged.items() if seq not in held}
    for seq in _dropped_as_damaged(log, other) if other else ():
        del other[seq]
    if other:
        first = min(other)
        more = f" (and {len(other) - 1} more damaged rows)" if len(other) > 1 else ""
        raise RunDirError(
            f"{other[first]}{more}: a row of the run's history, not a held trace's, which --drop-damaged "
            "does not drop; restore the run directory from a copy"
        )


def _dropped_as_damaged(log: EventLog, seqs: dict[int, str]) -> set[int]:
    """Which rows of `seqs` are the episode_completed of a trace that an earlier `--drop-damaged`
    resume dropped (its `run_resumed.damaged_traces`): damage known and logged, which later
    resumes fold around."""
    runs = log.read(kinds=("run_resumed",))
    dropped = {ev.episode_of(trace_id) for rec in runs for trace_id in rec.data.get("damaged_traces", ())}
    known = set()
    for seq in seqs if dropped else ():
        try:
            [row] = log.read(start=seq, stop=seq)
        except LogError:  # its data does not even decode
            continue
        if row.kind == "episode_completed" and isinstance(row.data, dict) and row.data.get("episode_id") in dropped:
            known.add(seq)
    return known


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
        with open_orch_log(db) as reader:
            meta = reader.meta
    except (LogNotFoundError, OrchLogError) as err:
        raise RunDirError(str(err)) from None
    if "config" not in meta:
        raise RunDirError(f"{db} is an orch event log, but not one written by `orch run` (it holds no config)")
    try:
        stored_json = orjson.loads(meta["config"])
    except orjson.JSONDecodeError:
        stored_json = None
    if not isinstance(stored_json, dict):
        raise RunDirError(f"{db} is corrupted: the run's stored config is not a JSON object")
    try:
        return load_config(base=stored_json), meta.get(MODEL_HASH_META)
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

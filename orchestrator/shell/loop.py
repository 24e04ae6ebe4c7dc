"""The imperative shell: collect inputs -> decide -> append + commit -> perform effects.

Write-ahead: an effect (start or cancel a rollout, start or cancel a background finalize, write
a batch file) is performed only after the events that call for it are committed. Every task the
loop starts has an owner, an `orchestrator.tasks.TaskOwner`: the run's (the outcome forwarders,
the trainer's task, weight reloads), the background finalizer's (algorithm code) or a rollout
stream's. Each reports its tasks' failures to the loop, which raises the first between two
iterations; `_shutdown` closes them in order, each with a bound, since their work may ignore its
cancellation.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

from eventlog import Recorder, SideFileLeftError, StorageError
from orchestrator.collection.collect import ExampleFeed, Outcome, run_examples
from orchestrator.config import RunConfig
from orchestrator.contracts import Algorithm, InferenceBackend, RolloutRequest, Trainer, episode_error
from orchestrator.core import events as ev
from orchestrator.core.batch import batch_sha256, encode_batch, sample_of
from orchestrator.core.decide import decide
from orchestrator.core.state import (
    REDUCER_VERSION,
    Group,
    ShippedSample,
    State,
    episodes_with_arrays,
    state_bytes,
)
from orchestrator.effects import perform
from orchestrator.notices import warn
from orchestrator.rundir import atomic_write_bytes, batch_path, batch_steps_on_disk
from orchestrator.shell.evals import eval_request, eval_result
from orchestrator.shell.zero_output import NO_SAMPLE_ERROR, ZeroOutputWitness
from orchestrator.tasks import TaskOwner

POLL_S = 0.5  # the longest the loop sleeps without re-checking failures and bounds
MAX_INPUTS_PER_ITERATION = 256  # bounds the synchronous decide work between two awaits
SHUTDOWN_STEP_S = 10.0  # the longest each shutdown step waits for what it cancelled


class StalledError(RuntimeError):
    """Nothing arrived for longer than the configured bound; says what the loop waited for."""


class FinalizeError(RuntimeError):
    """A background finalize raised; chained to the original exception and its traceback."""


class BatchWriteError(RuntimeError):
    """A shipped batch's file could not be written (disk full, permissions). The batch is in the
    log: a resume writes the file again. (A file that a trainer reads and finds malformed is
    `rundir.BatchFileError`.)"""


class BackgroundFinalizer:
    """Runs the algorithm's `finalize_group`, one owned task per group; its result or failure
    comes back as a loop input (`BackgroundFinalized`, `FinalizeFailed`), and a failure is also
    reported to `on_failure` as a `FinalizeError` for the loop to raise."""

    def __init__(
        self, algorithm: Algorithm, deliver: Callable[[object], None], on_failure: Callable[[BaseException], None]
    ):
        self.algorithm, self.deliver = algorithm, deliver
        self.tasks = TaskOwner("background finalize", on_failure)

    def __len__(self) -> int:
        """Groups finalizing (not cancelled)."""
        return len(self.tasks.keys())

    def start(self, group_id: int, episodes: Sequence[ev.EpisodeCompleted]) -> None:
        """Finalize `group_id`, cancelling a finalize of it still running."""
        episode_ids = [e.episode_id for e in episodes]
        self.tasks.start(
            self._finalize(group_id, episode_ids, episodes), name=f"orch-finalize-{group_id}", key=group_id
        )

    async def _finalize(self, group_id: int, episode_ids: list[int], episodes: Sequence[ev.EpisodeCompleted]) -> None:
        try:
            advantages = await self.algorithm.finalize_group(group_id, episodes)
            result = ev.checked(
                ev.BackgroundFinalized, group_id=group_id, episode_ids=episode_ids, advantages=advantages
            )
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            self.deliver(ev.FinalizeFailed(group_id=group_id, error=cause))
            raise FinalizeError(f"background finalize of group {group_id} failed: {cause}") from exc
        self.deliver(result)

    def cancel(self, group_id: int) -> None:
        self.tasks.cancel(group_id)


class Orchestrator:
    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        log: Recorder,
        state: State,
        *,
        backend: InferenceBackend,
        algorithm: Algorithm,
        trainer: Trainer,
        progress=None,
        stall_timeout_s: float | None = None,
        sinks=None,
    ):
        self.config, self.run_dir, self.log, self.state = config, run_dir, log, state
        self._solved = {name: getattr(config.env, name).solved for name in config.eval.envs}  # envs' success notions
        self.backend, self.trainer, self.progress = backend, trainer, progress
        self.sinks = sinks  # observe.sinks.SinkFeeder: metric sinks fed from the committed log
        self.stall_timeout_s = stall_timeout_s or config.trainer.publish_timeout_s
        self._finalized: deque = deque()  # background results: settled before rollout outputs
        self._outcomes: deque[Outcome] = deque()
        self._versions: deque[tuple[int, dict | None]] = deque()  # (version, the trainer's metrics)
        self._control: deque = deque()  # stop requests
        self._wake: asyncio.Event | None = None
        self._task_error: BaseException | None = None  # the first failure of a task, raised by the loop
        self._tasks = TaskOwner("the run", self._task_failed)  # forwarders, the trainer, reloads
        self.finalizer = BackgroundFinalizer(algorithm, self._deliver_finalized, self._task_failed)
        self._last_snapshot_seq = log.last_seq
        self._last_input_at = time.monotonic()
        self.last_episode_error: str | None = None  # what a run stopped for zero output last failed on
        self.zero_output = ZeroOutputWitness()  # why a run stopped for zero output, if it does
        self.events_logged = 0
        # What the effect interpreter asked for in this step that waits until its pass is over.
        self._batch_payloads: dict[int, bytes] = {}
        self._batches_to_write: list[tuple[int, bytes]] = []
        self._batches_to_announce: list[ev.BatchShipped] = []
        self._versions_published: list[int] = []
        self._unremovable_batches: set[int] = set()  # trained batch files whose removal failed (said once)
        # log.token_arrays until_trained: every episode row below this seq has had its arrays
        # dropped (or never had any to drop); a resume starts from the log's first row.
        self._arrays_kept_from = 1
        self._side_file_removal_failed = False  # said once
        self._drain_due = self._snapshot_due = False
        trainer.report_restarts_to(self.trainer_restarted)

    # --- inputs from the outside world (called on the loop thread) ---------------------------

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _deliver_finalized(self, event) -> None:
        self._finalized.append(event)
        self._poke()

    def publish_version(self, version: int, metrics: dict | None = None) -> None:
        self._versions.append((version, metrics))
        self._poke()

    def trainer_restarted(self, attempt: int, cause: str) -> None:
        self._control.append(ev.TrainerRestarted(attempt=attempt, cause=cause))
        self._poke()

    def endpoint_changed(self, url: str, up: bool, attempt: int, cause: str) -> None:
        self._control.append(ev.EndpointChanged(url=url, up=up, attempt=attempt, cause=cause))
        self._poke()

    def request_stop(self, reason: str) -> None:
        self._control.append(ev.StopRequested(reason=reason))
        self._poke()

    # --- the loop ------------------------------------------------------------------------------

    async def run(self, first_input) -> State:
        """Drive the run from `first_input` (run_started or run_resumed) until run_stopped; every
        task it starts has an owner, which `_shutdown` closes."""
        self._wake = asyncio.Event()
        self.feed: ExampleFeed = ExampleFeed()
        self.stream = run_examples(self.feed, self.backend)
        # Evals have a stream of their own: the drain closes the train stream, while evals go on
        # to the end's eval (docs/evals.md). The core caps what is in flight; so does the stream.
        self.eval_feed: ExampleFeed = ExampleFeed()
        self.eval_stream = run_examples(self.eval_feed, self.backend, max_concurrency=self.config.eval.max_inflight)
        self._tasks.start(self._forward_outcomes(self.stream), name="orch-outcomes")
        self._tasks.start(self._forward_outcomes(self.eval_stream), name="orch-eval-outcomes")
        self._tasks.start(self.trainer.run(self.state.version, self.publish_version), name="orch-trainer")
        self._tasks.start(self.backend.watch(self.endpoint_changed), name="orch-endpoints-watch")
        try:
            await self._drive(first_input)
        finally:
            await self._shutdown()
        return self.state

    async def _drive(self, first_input) -> None:
        await self._handle([first_input])
        while not self.state.stopped:
            self._wake.clear()
            inputs = self._take_inputs()
            if inputs:
                await self._handle(inputs)
            if not self._finalized:  # a failure is logged (finalize_failed) before it is raised
                self._raise_if_failed()
            if not inputs and not self.state.stopped:
                await self._wait_for_inputs()

    def _task_failed(self, error: BaseException) -> None:
        """A task's failure is kept for the loop to raise between two iterations (rule 3), never
        in the middle of one (a commit in progress, its effects not yet performed)."""
        if self._task_error is None:
            self._task_error = error
        self._poke()

    async def _forward_outcomes(self, stream) -> None:
        while await stream.wait_ready(None):
            self._outcomes.extend(stream.take_ready())
            self._poke()

    def _take_inputs(self) -> list:
        """Background results first (rule 4), then rollout outputs, publishes, stop requests."""
        inputs = []
        while self._finalized:
            inputs.append(self._finalized.popleft())
        outcomes = self._outcomes
        for _ in range(min(len(outcomes), MAX_INPUTS_PER_ITERATION)):
            inputs.append(self._completion_of(outcomes.popleft()))
        while self._versions:
            version, metrics = self._versions.popleft()
            inputs.append(ev.checked(ev.VersionPublished, version=version, metrics=metrics))
        while self._control:
            inputs.append(self._control.popleft())
        if inputs:
            self._last_input_at = time.monotonic()
        return inputs

    def _completion_of(self, outcome: Outcome) -> ev.EpisodeCompleted | ev.EvalEpisodeCompleted:
        req: RolloutRequest = outcome.example
        if req.eval_id is not None:
            return eval_result(outcome, self._solved[req.env])
        if outcome.exception is None:
            try:
                done = ev.checked_episode(outcome.result)
            except ValueError as err:  # a bad episode is the env's mistake: it fails, the log stays readable
                self.last_episode_error = episode_error(err)
            else:
                if not done.ok or done.n_tokens:
                    return done
                # An env's mistake, not the run's: the episode fails with the reason (docs/rules.md, "Samples").
                self.last_episode_error = NO_SAMPLE_ERROR
        else:
            self.last_episode_error = episode_error(outcome.exception)
        return ev.EpisodeCompleted(
            episode_id=req.episode_id,
            group_id=req.group_id,
            ok=False,
            reward=0.0,
            temperature=1.0,
            policy_start=req.policy_version,
            policy_end=self.state.version,
            error=self.last_episode_error,
        )

    async def _wait_for_inputs(self) -> None:
        try:
            async with asyncio.timeout(POLL_S):
                await self._wake.wait()
        except TimeoutError:
            idle = time.monotonic() - self._last_input_at
            if idle > self.stall_timeout_s:
                raise StalledError(f"no progress for {idle:.1f}s while waiting for {self.waiting_for()}") from None

    def waiting_for(self) -> str:
        s = self.state
        parts = []
        if s.inflight:
            parts.append(f"{len(s.inflight)} in-flight episodes")
        if s.evals.inflight:
            parts.append(f"{len(s.evals.inflight)} in-flight eval episodes")
        if finalizing := len(self.finalizer):
            parts.append(f"{finalizing} finalizing groups")
        parts.append(f"the trainer to publish version {s.version + 1}")
        return ", ".join(parts)

    def _raise_if_failed(self) -> None:
        """Rule 3: a background error surfaces here, at the next iteration, never swallowed."""
        if self._task_error is not None:
            raise self._task_error
        self.trainer.check()

    # --- decide, log, act ----------------------------------------------------------------------

    async def _handle(self, inputs: list) -> None:
        log, state = self.log, self.state
        logged: list = []
        batch_payloads = self._batch_payloads = {}
        for event in inputs:
            log.append_json(*ev.encode_event(event))
            logged.append(event)
            if event.kind == "episode_completed" and event.episode_id in state.inflight:
                self.zero_output.saw(event)  # in log order, and not a late one the core refuses
            for decision in decide(state, event, batch_payloads):
                log.append_json(*ev.encode_event(decision))
                logged.append(decision)
                self.zero_output.decided(decision)
        self.events_logged += len(logged)
        # Durable before any effect (write-ahead). In a thread: rollouts keep running meanwhile,
        # and nothing else touches the log until this returns.
        await asyncio.to_thread(log.commit)
        perform(state, logged, self)
        if self.progress is not None:
            self.progress.on_commit(state)
        if self._drain_due:
            self._drain_due = False
            await self._drain_rollouts()
        versions, self._versions_published = self._versions_published, []
        if self.backend.follows_weights:  # inference loads the published weights
            for version in versions:
                self._spawn_reload(version)
        batches, self._batches_to_write = self._batches_to_write, []
        if batches:  # file I/O off the loop thread; the trainer hears of them afterwards
            await asyncio.to_thread(self._write_batches, batches)
        if versions:
            await asyncio.to_thread(self.remove_trained_batches)
            await asyncio.to_thread(self.drop_unneeded_token_arrays)
        announced, self._batches_to_announce = self._batches_to_announce, []
        for e in announced:
            self.trainer.batch_written(e.step, e.sha256)
            if self.progress is not None:
                self.progress.on_batch(e, self.state, self)
        if self.sinks is not None and (announced or versions):
            await self.sinks.feed(log.last_seq)  # the commits that complete rows
        every = self.config.log.snapshot_every
        if self._snapshot_due or (every and log.last_seq - self._last_snapshot_seq >= every):
            self._snapshot_due = False
            self._save_snapshot()

    # --- the effect port (orchestrator.effects): what a step's events call for ------------------

    def start_rollout(self, dispatched: ev.EpisodeDispatched, group: Group) -> None:
        e = dispatched
        self.feed.put(
            RolloutRequest(e.episode_id, e.group_id, group.env, group.task_id, e.attempt, e.policy_version),
            key=e.episode_id,
        )

    def cancel_rollout(self, episode_id: int) -> None:
        self.stream.cancel(episode_id)

    def start_eval_rollout(self, dispatched: ev.EvalEpisodeDispatched) -> None:
        self.eval_feed.put(eval_request(self.state, dispatched), key=dispatched.episode_id)

    def cancel_eval_rollout(self, episode_id: int) -> None:
        self.eval_stream.cancel(episode_id)

    def report_eval(self, completed: ev.EvalCompleted) -> None:
        if self.progress is not None:
            self.progress.on_eval(completed)

    def start_finalize(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None:
        self.finalizer.start(started.group_id, episodes)

    def cancel_finalize(self, group_id: int) -> None:
        self.finalizer.cancel(group_id)

    def write_batch(self, shipped: ev.BatchShipped) -> None:
        self._batches_to_write.append((shipped.step, self._batch_payloads[shipped.step]))

    def notify_trainer(self, shipped: ev.BatchShipped) -> None:
        self._batches_to_announce.append(shipped)

    def load_version(self, version: int) -> None:
        self._versions_published.append(version)

    def drain(self) -> None:
        # The core already cancelled every in-flight episode; admission stops and the outcomes
        # that completed meanwhile reach the core (it books them as late).
        self._drain_due = True

    def snapshot(self) -> None:
        self._snapshot_due = True

    async def _drain_rollouts(self) -> None:
        """Bounded by SHUTDOWN_STEP_S. A rollout that ignores its cancellation is reported, not
        raised: its episode is already cancelled in the log, so the run goes on to its end."""
        try:
            await self.stream.aclose_and_drain(timeout=SHUTDOWN_STEP_S)
        except TimeoutError as err:
            warn(err)

    def _spawn_reload(self, version: int) -> None:
        self._tasks.start(self.backend.load(version), name=f"orch-reload-{version}")

    @staticmethod
    def batch_payload(step: int, samples: list[ShippedSample]) -> bytes:
        return encode_batch(step, [sample_of(s.trace, s.env, s.advantage, s.lag, s.weight) for s in samples])

    def _write_batches(self, batches: list[tuple[int, bytes]]) -> None:
        """Write shipped batch files (atomic). Runs in a worker thread while the loop awaits it.
        Not fsynced: the log is durable and a file can be rebuilt from it; one that a power loss
        leaves missing or partial fails its sha256 on resume and is re-written."""
        for step, payload in batches:
            self._write_batch(step, payload)

    def _write_batch(self, step: int, payload: bytes) -> None:
        path = batch_path(self.run_dir, step)
        try:
            atomic_write_bytes(path, payload, durable=False)
        except OSError as err:
            raise BatchWriteError(f"cannot write the batch file {path}: {err.strerror or err}") from err

    def remove_trained_batches(self) -> None:
        """log.batch_files until_trained: the batch files of the steps the published version has
        trained on are removed (the trainer checkpoints a step before it publishes it, so no
        restart reads them again; docs/resume.md). Only untrained batches stay in the directory,
        a few, so listing it is cheap."""
        if self.config.log.batch_files != "until_trained":
            return
        for step in batch_steps_on_disk(self.run_dir):
            if step <= self.state.version and step not in self._unremovable_batches:
                path = batch_path(self.run_dir, step)
                try:
                    path.unlink(missing_ok=True)
                except OSError as err:  # a file left is disk used, not a wrong run: said once, not raised
                    self._unremovable_batches.add(step)
                    warn(f"cannot remove the trained batch file {path}: {err.strerror or err}")

    def drop_unneeded_token_arrays(self) -> None:
        """log.token_arrays until_trained: the token arrays of every episode the state no longer
        holds (its samples trained on by a published version, or dropped) are dropped from the log,
        each row keeping their sha256 (docs/resume.md). A resume's fold reads the arrays of the
        traces still held and of the batches shipped and not yet trained, and nothing else: what is
        dropped here, no resume needs. Runs after the commit, on the committed state."""
        if self.config.log.token_arrays != "until_trained":
            return
        needed = episodes_with_arrays(self.state)
        start, unneeded, kept_from = self._arrays_kept_from, [], None
        for seq, (kind, data) in enumerate(self.log.read_bodies(start=start), start):
            if kind != "episode_completed":
                continue
            if orjson.loads(data).get("episode_id") in needed:
                kept_from = seq if kept_from is None else kept_from
            else:
                unneeded.append(seq)
        try:
            self.log.drop_payloads(unneeded)
        except SideFileLeftError as err:  # disk used, not a wrong run: said once
            if not self._side_file_removal_failed:
                self._side_file_removal_failed = True
                warn(str(err))
        except StorageError as err:  # nothing dropped: tried again from the same row at the next publish
            warn(f"token arrays not dropped this time (log.token_arrays): {err}")
            return
        self._arrays_kept_from = kept_from if kept_from is not None else self.log.last_seq + 1

    def rematerialize_batches(self) -> int:
        """Resume: rewrite shipped-but-untrained batch files that are missing or partial. Called
        before the trainer starts (it could read a partial file) and before anything new ships
        (trainers read in order)."""
        rewritten = 0
        for step in sorted(self.state.shipped_batches):
            payload = self.batch_payload(step, self.state.shipped_batches[step])
            sha = batch_sha256(payload)
            path = batch_path(self.run_dir, step)
            if not path.is_file() or batch_sha256(path.read_bytes()) != sha:
                self._write_batch(step, payload)
                rewritten += 1
            self.trainer.batch_written(step, sha)
        return rewritten

    def _save_snapshot(self) -> None:
        if self.config.log.snapshot_every and self.log.last_seq > self._last_snapshot_seq:
            self.log.save_snapshot(self.log.last_seq, REDUCER_VERSION, state_bytes(self.state))
            self._last_snapshot_seq = self.log.last_seq

    # --- shutdown: bounded, nothing left running -----------------------------------------------

    async def _shutdown(self) -> None:
        """The shutdown order: the rollout streams, the background finalizes, then the run's own
        tasks. Every step runs, each bounded by SHUTDOWN_STEP_S. A task that ignores its
        cancellation is reported, not raised: the run's own outcome stands (its events are all
        committed), and the steps after it still run."""
        self._wake = None
        for stream in (self.stream, self.eval_stream):
            try:
                await stream.aclose(timeout=SHUTDOWN_STEP_S)
            except TimeoutError as err:
                warn(err)
        for owner in (self.finalizer.tasks, self._tasks):
            try:
                await owner.aclose(SHUTDOWN_STEP_S)
            except TimeoutError as err:
                warn(err)

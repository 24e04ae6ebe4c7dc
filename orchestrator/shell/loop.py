"""The imperative shell: collect inputs -> decide -> append + commit -> perform effects.

Write-ahead: an effect (start or cancel a rollout, start or cancel a background finalize, write
a batch file) is performed only after the events that call for it are committed. Every task the
loop starts has an owner here that awaits or cancels it; `run()` never returns with one alive.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import RunConfig
from orchestrator.core import events as ev
from orchestrator.core.batch import batch_sha256, encode_batch, sample_record
from orchestrator.core.decide import decide
from orchestrator.core.state import REDUCER_VERSION, ShippedSample, State, state_bytes
from orchestrator.embedded.files import atomic_write_bytes, batch_path
from orchestrator.rollouts.collect import ExampleFeed, Outcome, run_examples
from orchestrator.shell.algorithms import Algorithm
from orchestrator.shell.rollouts import RolloutRequest

POLL_S = 0.5  # the longest the loop sleeps without re-checking failures and bounds
MAX_INPUTS_PER_ITERATION = 256  # bounds the synchronous decide work between two awaits
COMMIT_TIMEOUT_S = 60.0  # at shutdown: a group commit in flight finishes before the log closes
BATCH_FLUSH_TIMEOUT_S = 60.0  # at the end of a run: the last batch files must reach the disk


class StalledError(RuntimeError):
    """Nothing arrived for longer than the configured bound; says what the loop waited for."""


class FinalizeError(RuntimeError):
    """A background finalize raised; chained to the original exception and its traceback."""


@dataclass
class LoopHooks:
    """Effects owned by other components, injected so tests and benchmarks can swap them."""

    rollout: Callable[[RolloutRequest], Awaitable[ev.EpisodeCompleted]]
    on_version: Callable[[int], Awaitable[None]] | None = None  # e.g. reload inference weights


class BackgroundFinalizer:
    """Owns the background `finalize_group` tasks; results come back as loop inputs."""

    def __init__(self, algorithm: Algorithm, deliver: Callable[[object], None]):
        self.algorithm, self.deliver = algorithm, deliver
        self.tasks: dict[int, asyncio.Task] = {}
        self.error: BaseException | None = None
        self.error_group: int | None = None

    def start(self, group_id: int, traces: Sequence[ev.EpisodeCompleted]) -> None:
        self.cancel(group_id)
        trace_ids = [t.episode_id for t in traces]
        task = asyncio.get_running_loop().create_task(self.algorithm.finalize_group(group_id, traces))
        task.add_done_callback(lambda t: self._done(group_id, trace_ids, t))
        self.tasks[group_id] = task

    def _done(self, group_id: int, trace_ids: list[int], task: asyncio.Task) -> None:
        if self.tasks.get(group_id) is task:
            del self.tasks[group_id]
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here, so never "never retrieved"
        if exc is not None:
            if self.error is None:
                self.error, self.error_group = exc, group_id
            self.deliver(ev.FinalizeFailed(group_id=group_id, error=f"{type(exc).__name__}: {exc}"))
        else:
            self.deliver(ev.GroupFinalized(group_id=group_id, trace_ids=trace_ids, advantages=task.result()))

    def cancel(self, group_id: int) -> None:
        task = self.tasks.pop(group_id, None)
        if task is not None:
            task.cancel()

    async def aclose(self, timeout_s: float) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


@dataclass
class _Commit:
    """A sealed group of events being written, and what it calls for once durable."""

    task: asyncio.Task
    inputs: list
    decided: list
    snapshot_seq: int
    snapshot: bytes | None  # the state as of its last event, when a snapshot was due


class BatchWriter:
    """Writes shipped batch files off the loop thread, one at a time in step order, and announces
    each to the trainer once it is on disk. The loop goes on deciding while the disk syncs; its
    batch_shipped events are already committed (write-ahead), so a crash before a file lands is
    repaired on resume (`rematerialize_batches`)."""

    def __init__(self, write: Callable[[int, str, list[ShippedSample]], None],
                 written: Callable[[int, str], None]):
        self._write, self._written = write, written
        self._queue: deque[tuple[int, str, list[ShippedSample]]] = deque()
        self._task: asyncio.Task | None = None

    def submit(self, step: int, sha256: str, samples: list[ShippedSample]) -> None:
        self._queue.append((step, sha256, samples))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="orch-batch-writer")

    async def _drain(self) -> None:
        while self._queue:
            step, sha256, samples = self._queue[0]
            await asyncio.to_thread(self._write, step, sha256, samples)
            self._queue.popleft()
            self._written(step, sha256)
        self._task = None

    def check(self) -> None:
        """Raise the error of a failed write (the task stays, so it is raised again next time)."""
        task = self._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    async def flush(self, timeout_s: float) -> None:
        """Wait until every submitted batch is on disk and announced."""
        task = self._task
        if task is None:
            return
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        if not done:
            raise TimeoutError(f"{len(self._queue)} batch files still being written after {timeout_s:.0f}s")
        self.check()

    async def aclose(self, timeout_s: float) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=timeout_s)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failure was already raised by check()


class Orchestrator:
    def __init__(self, config: RunConfig, run_dir: Path, log, state: State, *, hooks: LoopHooks,
                 algorithm: Algorithm, trainer, progress=None, stall_timeout_s: float | None = None):
        self.config, self.run_dir, self.log, self.state = config, run_dir, log, state
        self.hooks, self.trainer, self.progress = hooks, trainer, progress
        self.stall_timeout_s = stall_timeout_s or config.trainer.publish_timeout_s
        self._finalized: deque = deque()  # background results: settled before rollout outputs
        self._outcomes: deque[Outcome] = deque()
        self._versions: deque[int] = deque()
        self._control: deque = deque()  # stop requests
        self._wake: asyncio.Event | None = None
        self.finalizer = BackgroundFinalizer(algorithm, self._deliver_finalized)
        self.batch_writer = BatchWriter(self._write_batch, trainer.batch_written)
        self._last_snapshot_seq = log.last_seq
        self._last_input_at = time.monotonic()
        self._reloads: set[asyncio.Task] = set()  # inference weight reloads in progress
        self._reload_error: BaseException | None = None
        self.events_logged = 0
        self._commit: _Commit | None = None  # the group commit in flight

    # --- inputs from the outside world (called on the loop thread) ---------------------------

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _deliver_finalized(self, event) -> None:
        self._finalized.append(event)
        self._poke()

    def publish_version(self, version: int) -> None:
        self._versions.append(version)
        self._poke()

    def request_stop(self, reason: str) -> None:
        self._control.append(ev.StopRequested(reason=reason))
        self._poke()

    # --- the loop ------------------------------------------------------------------------------

    async def run(self, first_input) -> State:
        """Drive the run from `first_input` (run_started or run_resumed) until run_stopped."""
        self._wake = asyncio.Event()
        self.feed: ExampleFeed = ExampleFeed()
        self.stream = run_examples(self.feed, self.hooks.rollout)
        loop = asyncio.get_running_loop()
        owned = [loop.create_task(self._forward_outcomes(), name="orch-outcomes"),
                 loop.create_task(self.trainer.run(self.state.version), name="orch-trainer")]
        try:
            if first_input.kind == "run_resumed":  # before anything new ships: trainers read in order
                self.rematerialize_batches()
            self._start_commit([first_input], self._decide([first_input]))
            while not self.state.stopped:
                self._wake.clear()
                inputs = self._take_inputs()
                decided = self._decide(inputs) if inputs else []  # while the previous group commits
                await self._finish_commit()
                if inputs:
                    self._start_commit(inputs, decided)
                if not self._finalized:  # a failure is logged (finalize_failed) before it is raised
                    self._raise_if_failed(owned)
                if not inputs and not self.state.stopped:
                    await self._wait_for_inputs()
            await self._finish_commit()
            await self.batch_writer.flush(timeout_s=BATCH_FLUSH_TIMEOUT_S)
            self._save_snapshot()
            return self.state
        finally:
            await self._shutdown(owned)

    async def _forward_outcomes(self) -> None:
        stream = self.stream
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
            inputs.append(ev.VersionPublished(version=self._versions.popleft()))
        while self._control:
            inputs.append(self._control.popleft())
        if inputs:
            self._last_input_at = time.monotonic()
        return inputs

    def _completion_of(self, outcome: Outcome) -> ev.EpisodeCompleted:
        req: RolloutRequest = outcome.example
        if outcome.exception is None:
            return outcome.result
        exc = outcome.exception
        return ev.EpisodeCompleted(
            episode_id=req.episode_id, group_id=req.group_id, ok=False,
            policy_start=req.policy_version, policy_end=self.state.version,
            error=f"{type(exc).__name__}: {exc}",
        )

    async def _wait_for_inputs(self) -> None:
        try:
            async with asyncio.timeout(POLL_S):
                await self._wake.wait()
        except TimeoutError:
            idle = time.monotonic() - self._last_input_at
            if idle > self.stall_timeout_s:
                raise StalledError(f"no progress for {idle:.0f}s while waiting for {self.waiting_for()}") from None

    def waiting_for(self) -> str:
        s = self.state
        parts = []
        if s.inflight:
            parts.append(f"{len(s.inflight)} in-flight episodes")
        if self.finalizer.tasks:
            parts.append(f"{len(self.finalizer.tasks)} finalizing groups")
        parts.append(f"the trainer to publish version {s.version + 1}")
        return ", ".join(parts)

    def _raise_if_failed(self, owned: list[asyncio.Task]) -> None:
        """Rule 10: a background error surfaces here, at the next iteration, never swallowed."""
        if self.finalizer.error is not None:
            raise FinalizeError(
                f"background finalize of group {self.finalizer.error_group} failed: "
                f"{type(self.finalizer.error).__name__}: {self.finalizer.error}"
            ) from self.finalizer.error
        if self._reload_error is not None:
            raise self._reload_error
        self.batch_writer.check()
        for task in owned:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        self.trainer.check()

    # --- decide, log, act ----------------------------------------------------------------------

    def _decide(self, inputs: list) -> list:
        """Fold the inputs through the core and append them and their decisions to the log."""
        log, state = self.log, self.state
        decided = []
        for event in inputs:
            kind, data = ev.encode_event(event)
            log.append_json(kind, data)
            for decision in decide(state, event):
                kind, data = ev.encode_event(decision)
                log.append_json(kind, data)
                decided.append(decision)
        self.events_logged += len(inputs) + len(decided)
        return decided

    def _start_commit(self, inputs: list, decided: list) -> None:
        """Write the appended events in a worker thread. The loop goes on deciding the next
        inputs meanwhile (group commits are pipelined), but performs these events' effects only
        once they are durable (`_finish_commit`): write-ahead."""
        log = self.log
        sealed = log.seal()
        snapshot = None
        every = self.config.log.snapshot_every
        if every and log.next_seq - 1 - self._last_snapshot_seq >= every:
            # The state now is the state as of the last sealed event: snapshot it here.
            snapshot = state_bytes(self.state)
            self._last_snapshot_seq = log.next_seq - 1
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(log.commit_sealed, sealed))
        self._commit = _Commit(task, inputs, decided, self._last_snapshot_seq, snapshot)

    async def _finish_commit(self) -> None:
        """Wait for the group commit in flight (if any), then perform its effects."""
        commit, self._commit = self._commit, None
        if commit is None:
            return
        await commit.task
        if commit.snapshot is not None:
            self.log.save_snapshot(commit.snapshot_seq, REDUCER_VERSION, commit.snapshot)
        for decision in commit.decided:
            self._perform(decision)
        if any(decision.kind == "drain_started" for decision in commit.decided):
            # The core already cancelled every in-flight episode; stop admission and let the
            # outcomes that completed meanwhile reach the core (it books them as late).
            await self.stream.aclose_and_drain(timeout=10.0)
        if self.hooks.on_version is not None:
            for event in commit.inputs:  # an input with an effect: inference loads the published weights
                if event.kind == "version_published":
                    self._spawn_reload(event.version)
        for e in commit.decided:  # the file is written in the background; the trainer hears of it then
            if e.kind == "batch_shipped":
                self.batch_writer.submit(e.step, e.sha256, self.state.shipped_batches[e.step])
                if self.progress is not None:
                    self.progress.on_batch(e, self.state, self)

    def _perform(self, e) -> None:
        state = self.state
        kind = e.kind
        if kind == "episode_dispatched":
            if e.episode_id in state.inflight:  # not already cancelled in the same iteration
                group = state.groups[e.group_id]
                req = RolloutRequest(e.episode_id, e.group_id, group.env, group.task_id, e.attempt, e.policy_version)
                self.feed.put(req, key=e.episode_id)
        elif kind == "episode_cancelled":
            self.stream.cancel(e.episode_id)
        elif kind == "finalize_started":
            group = state.groups.get(e.group_id)
            if e.background and group is not None and group.finalizing:
                self.finalizer.start(e.group_id, [state.traces[t] for t in e.trace_ids])
        elif kind == "group_cancelled":
            self.finalizer.cancel(e.group_id)

    def _spawn_reload(self, version: int) -> None:
        # Owned here: reloads are short, their errors surface in _raise_if_failed, and shutdown
        # cancels and awaits whatever is left.
        task = asyncio.get_running_loop().create_task(self.hooks.on_version(version))
        self._reloads.add(task)
        task.add_done_callback(self._reload_done)

    def _reload_done(self, task: asyncio.Task) -> None:
        self._reloads.discard(task)
        if not task.cancelled() and task.exception() is not None and self._reload_error is None:
            self._reload_error = task.exception()

    @staticmethod
    def batch_payload(step: int, samples: list[ShippedSample]) -> bytes:
        return encode_batch(step, (sample_record(s.trace, s.env, s.advantage, s.lag) for s in samples))

    def _write_batch(self, step: int, sha256: str, samples: list[ShippedSample]) -> None:
        """Write one shipped batch file (atomic). Runs in a worker thread."""
        payload = self.batch_payload(step, samples)
        if batch_sha256(payload) != sha256:
            raise AssertionError(f"batch {step}: rebuilt payload does not match its logged sha256")
        # Not fsynced: the log is durable and the file can be rebuilt from it; a file a power
        # loss leaves missing or partial fails its sha256 on resume and is re-written.
        atomic_write_bytes(batch_path(self.run_dir, step), payload, durable=False)

    def rematerialize_batches(self) -> int:
        """Resume: rewrite shipped-but-untrained batch files that are missing or partial."""
        rewritten = 0
        for step in sorted(self.state.shipped_batches):
            payload = self.batch_payload(step, self.state.shipped_batches[step])
            sha = batch_sha256(payload)
            path = batch_path(self.run_dir, step)
            if not path.exists() or batch_sha256(path.read_bytes()) != sha:
                atomic_write_bytes(path, payload, durable=False)
                rewritten += 1
            self.trainer.batch_written(step, sha)
        return rewritten

    def _save_snapshot(self) -> None:
        """At the end of a run, when no event is in flight: the state is the last seq's."""
        if self.config.log.snapshot_every and self.log.last_seq > self._last_snapshot_seq:
            self.log.save_snapshot(self.log.last_seq, REDUCER_VERSION, state_bytes(self.state))
            self._last_snapshot_seq = self.log.last_seq

    # --- shutdown: bounded, nothing left running -----------------------------------------------

    async def _shutdown(self, owned: list[asyncio.Task]) -> None:
        self._wake = None
        if self._commit is not None:  # not performed (a crash), but the log must be left whole
            commit, self._commit = self._commit, None
            await asyncio.wait([commit.task], timeout=COMMIT_TIMEOUT_S)
            if commit.task.done() and not commit.task.cancelled():
                commit.task.exception()  # retrieved; the error that stopped the loop is raised
        await self.stream.aclose(timeout=10.0)
        await self.finalizer.aclose(timeout_s=10.0)
        await self.batch_writer.aclose(timeout_s=10.0)
        reloads = list(self._reloads)
        for task in owned + reloads:
            task.cancel()
        await asyncio.wait(owned + reloads, timeout=10.0)
        for task in owned + reloads:  # retrieve, so nothing is reported as never retrieved
            if task.done() and not task.cancelled():
                task.exception()

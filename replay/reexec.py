"""`orch replay RUN --reexecute`: feed RUN's recorded inputs through `decide` on another finalize path.

The recorded *inputs* (run start and resumes, episode completions, version publishes, stop
requests) are handed to the current `decide`, with the run's params overridden to the chosen
finalize path, and everything is appended to a new log (same meta and config, plus a
`reexecuted` meta entry). RUN's decisions are not used: the new run decides its own.

The re-executor plays the shell's part for background finalization. When the new run decides
`finalize_started(background=True)` it supplies the `group_finalized` (or `finalize_failed`) input:

* the result RUN recorded for that group and those survivors, when there is one (replay never
  re-runs a grader), as the `background_finalized` input whether RUN received it as that input
  or decided it inline (`group_finalized`);
* else, for an algorithm the core can score inline (grpo), the pure scorer's result;
* else (a grader-only algorithm such as gar with no recorded result) the re-execution stops there
  and reports it as the divergence.

Delivery order (`settle_order`):

* ``recorded``  as RUN got it: at the recorded position of RUN's `background_finalized` input (a
  background RUN; a result RUN received after the group was cancelled is delivered, late, too),
  at once when RUN decided it inline; never when a background RUN received none for that request;
* ``immediate`` each result right after the decision that asked for it, before the next recorded
  input (docs/rules.md, 4. Settle: queued background results are settled before new inputs);
* ``shuffled``  held, then delivered in a seeded random order interleaved with later inputs (after
  each recorded input every held result has a `deliver_p` chance), the rest at the end.

Re-executing a background run inline skips RUN's recorded `background_finalized`/`finalize_failed`
inputs: the inline path decides its own. The re-executor is an effect port: the effect
interpreter (orchestrator.effects) tells it when a decision asks for a background finalize, or
cancels one. A recorded input the new run cannot accept (a
completion of an episode it never dispatched, or dispatched into another group) stops the
re-execution and is reported as the divergence, never a crash. Like the shell, a group that the
new run cancels gets no result.
"""

from __future__ import annotations

import os
import random
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
from pydantic import ValidationError

from eventlog import EventLog, LogError
from eventlog.lock import lock_path_for
from orchestrator.core import events as ev
from orchestrator.core.advantages import INLINE_SCORERS
from orchestrator.core.decide import decide
from orchestrator.core.state import State, initial_state
from orchestrator.effects import IgnoringPort, perform
from replay.inputs import decode
from replay.source import EVENTS_DB, REEXECUTED_META, ReplayInputError, guarded, one_line

FINALIZE_PATHS = ("inline", "background")
SETTLE_ORDERS = ("recorded", "immediate", "shuffled")
_RESERVED_META = {"magic", "format_version"}


@dataclass
class ReexecOptions:
    finalize: str = "background"
    settle_order: str = "recorded"
    seed: int = 0
    deliver_p: float = 0.25  # shuffled: chance per recorded input that a held result is delivered
    commit_every: int = 8192

    def __post_init__(self) -> None:
        if self.finalize not in FINALIZE_PATHS:
            raise ReplayInputError(f"--finalize must be inline or background, not {self.finalize!r}")
        if self.settle_order not in SETTLE_ORDERS:
            raise ReplayInputError(
                f"--settle-order must be one of {', '.join(SETTLE_ORDERS)}, not {self.settle_order!r}"
            )
        if not 0.0 < self.deliver_p <= 1.0:
            raise ReplayInputError("deliver_p must be in (0, 1]")


@dataclass
class ReexecReport:
    source: str
    out: str
    options: dict
    inputs_fed: int = 0  # recorded inputs handed to decide
    recorded_results_skipped: int = 0  # RUN's finalize results not fed as such (inline path, or supplied by us)
    results_reused: int = 0  # background results taken from RUN's log
    results_computed: int = 0  # background results computed with the pure scorer
    results_dropped: int = 0  # held results whose group the new run cancelled first
    results_withheld: int = 0  # recorded order: RUN (background) never received a result for that request
    late_inputs: int = 0  # completions for episodes the new run had cancelled (accepted as late)
    publishes_ahead: int = 0  # version publishes for a step the new run had not shipped yet
    events_written: int = 0
    stopped: bool = False
    stop_reason: str | None = None
    # {seq, input_kind, kind, data, reason}: the recorded input at `seq` (of `input_kind`) that the
    # new run could not accept, or whose decision of `kind` (with `data`) nobody could answer
    halted: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Entry:
    seq: int
    is_input: bool  # RUN received it as an input (background), vs decided it inline
    event: ev.BackgroundFinalized | ev.FinalizeFailed


class RecordedResults:
    """RUN's finalize results by group (one pre-pass over those kinds only, each row checked
    against its checksum as `--reexecute`'s other reads are)."""

    def __init__(self, log: EventLog):
        self.by_group: dict[int, list[_Entry]] = {}
        kinds = ("group_finalized", "background_finalized", "finalize_failed")
        for row in guarded(log.read_rows(kinds=kinds), log.path):
            seq, _ts, kind, _data, _payload = row
            event = decode(row, log.path)
            if isinstance(event, ev.GroupFinalized):  # decided inline: the new run receives it as an input
                event = ev.BackgroundFinalized(
                    group_id=event.group_id, episode_ids=event.episode_ids, advantages=event.advantages
                )
            self.by_group.setdefault(event.group_id, []).append(_Entry(seq, kind in ev.INPUT_KINDS, event))

    def take(self, group_id: int, episode_ids: list[int]) -> _Entry | None:
        """The first unused recorded result for this group and these survivors."""
        entries = self.by_group.get(group_id)
        if not entries:
            return None
        for i, entry in enumerate(entries):
            if isinstance(entry.event, ev.FinalizeFailed) or entry.event.episode_ids == episode_ids:
                del entries[i]
                return entry
        return None


class _Halt(Exception):
    def __init__(self, reason: str, kind: str = "", data: dict | None = None):
        super().__init__(reason)
        self.reason, self.kind, self.data = reason, kind, data


def out_db_path(out: str | os.PathLike) -> Path:
    """NEW is a run directory (NEW/events.db is created) or, ending in .db, the log file itself."""
    p = Path(out)
    return p if p.suffix == ".db" else p / EVENTS_DB


class Reexecutor(IgnoringPort):
    def __init__(self, source: EventLog, out: str | os.PathLike, options: ReexecOptions):
        self.source, self.options = source, options
        self.db = out_db_path(out)
        self.report = ReexecReport(str(source.path), str(self.db), asdict(options))
        self.state: State  # made by `_check_params` from RUN's run_started
        self.results = RecordedResults(source)
        self.rng = random.Random(options.seed)
        self.now: deque[ev.BackgroundFinalized | ev.FinalizeFailed] = deque()  # before the next recorded input
        # recorded seq -> (group id, result)
        self.scheduled: dict[int, tuple[int, ev.BackgroundFinalized | ev.FinalizeFailed]] = {}
        self.held: list[ev.BackgroundFinalized | ev.FinalizeFailed] = []  # shuffled: to deliver at random points
        self.cursor, self.cursor_kind = 0, ""  # the recorded row being processed
        self.source_background = False

    # --- the new log ------------------------------------------------------------------------------

    def _create_log(self) -> EventLog:
        meta = {k: v for k, v in self.source.meta.items() if k not in _RESERVED_META}
        meta[REEXECUTED_META] = orjson.dumps(
            {
                "from": str(self.source.path),
                "finalize": self.options.finalize,
                "settle_order": self.options.settle_order,
                "seed": self.options.seed,
            },
            option=orjson.OPT_SORT_KEYS,
        ).decode()
        try:
            self.db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ReplayInputError(f"--out: cannot create {self.db.parent}: {err.strerror}") from None
        try:
            return EventLog.create(self.db, meta=meta, durability="normal")
        except LogError as err:
            raise ReplayInputError(one_line(f"--out: {err}")) from None

    def _append(self, event) -> None:
        self.log.append_json(*ev.encode_event(event))
        self.report.events_written += 1
        if self.log.pending >= self.options.commit_every:
            self.log.commit()

    # --- feeding decide --------------------------------------------------------------------------

    def _feed(self, event: ev.Event) -> None:
        """One input to decide; append it and its decisions; perform what they call for."""
        decisions = decide(self.state, event)
        self._append(event)
        for decision in decisions:
            self._append(decision)
        perform(self.state, [event, *decisions], self)
        while self.now:
            self._feed(self.now.popleft())

    # --- the effect port: only background finalizes need an answer; completions and publishes
    # are recorded inputs, and a re-executed log is compared, not resumed (no files, no snapshot).

    def start_finalize(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None:
        self._finalize_requested(started, episodes)

    def cancel_finalize(self, group_id: int) -> None:
        if self.options.settle_order != "recorded":
            self._forget(group_id)

    def _forget(self, group_id: int) -> None:
        """The shell cancels a cancelled group's finalize task: its result never comes. (With the
        recorded order a result RUN received after the cancel is still delivered, late, as RUN got it.)"""
        before = len(self.held) + len(self.scheduled)
        self.held = [r for r in self.held if r.group_id != group_id]
        self.scheduled = {s: (g, r) for s, (g, r) in self.scheduled.items() if g != group_id}
        self.report.results_dropped += before - len(self.held) - len(self.scheduled)

    def _finalize_requested(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None:
        entry = self.results.take(started.group_id, started.episode_ids)
        order = self.options.settle_order
        if entry is not None:
            result = entry.event
            self.report.results_reused += 1
        elif order == "recorded" and self.source_background:
            self.report.results_withheld += 1  # RUN never received one: neither does the new run
            return
        elif (scorer := INLINE_SCORERS.get(self.state.params.algorithm)) is not None:
            result = ev.BackgroundFinalized(
                group_id=started.group_id,
                episode_ids=started.episode_ids,
                advantages=scorer([e.reward for e in episodes], self.state.params),
            )
            self.report.results_computed += 1
        else:
            raise _Halt(
                f"no recorded {self.state.params.algorithm} result for group {started.group_id} with survivors "
                f"{started.episode_ids}, and replay never re-runs a grader",
                started.kind,
                orjson.loads(ev.encode_event(started)[1]),
            )
        if order == "shuffled":
            self.held.append(result)
        elif order == "recorded" and entry is not None and entry.is_input and entry.seq > self.cursor:
            self.scheduled[entry.seq] = (started.group_id, result)
        else:
            self.now.append(result)

    def _deliver_some_held(self) -> None:
        while self.held and self.rng.random() < self.options.deliver_p:
            self._feed(self.held.pop(self.rng.randrange(len(self.held))))

    # --- recorded inputs -------------------------------------------------------------------------

    def _admit(self, event):
        """The recorded input as the new run takes it (params overridden), or _Halt if it cannot."""
        if event.kind == "run_started":
            background = self.options.finalize == "background"
            try:
                params = ev.CoreParams.model_validate(
                    {**event.params.model_dump(), "finalize_in_background": background}
                )
            except ValidationError as err:
                msg = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())  # the validator's own
                raise ReplayInputError(
                    one_line(f"cannot re-execute with --finalize {self.options.finalize}: {msg}")
                ) from None
            return ev.RunStarted(schema_version=event.schema_version, params=params)
        s = self.state
        if event.kind == "episode_completed":
            group_id = s.inflight.get(event.episode_id)
            if group_id is None:
                if event.episode_id >= s.next_episode_id:
                    raise _Halt(f"completion of episode {event.episode_id}, which the re-executed run never dispatched")
                self.report.late_inputs += 1
            elif group_id != event.group_id:
                raise _Halt(
                    f"completion of episode {event.episode_id} of group {event.group_id}, but the re-executed "
                    f"run dispatched that episode into group {group_id}"
                )
        elif event.kind == "version_published" and event.version > s.step - 1:
            self.report.publishes_ahead += 1
        return event

    def _check_params(self) -> None:
        """Refuse an impossible override (e.g. gar inline) before creating anything."""
        for row in guarded(self.source.read_raw(kinds=("run_started",), chunk_size=1), self.source.path):
            started = decode(row, self.source.path)
            self.state = initial_state(self._admit(started).params)
            self.source_background = started.params.finalize_in_background
            return
        raise ReplayInputError(f"{self.source.path} has no run_started event: nothing to re-execute")

    def run(self) -> ReexecReport:
        self._check_params()
        self.log = self._create_log()
        try:
            self._run()
            self.log.commit()
        except BaseException:
            # A half-written log must not pass for a result, nor keep its --out taken.
            self.log.discard()
            self.log.close()
            for path in (self.db, Path(f"{self.db}-wal"), Path(f"{self.db}-shm"), Path(lock_path_for(str(self.db)))):
                path.unlink(missing_ok=True)
            raise
        self.log.close()
        self.report.stopped, self.report.stop_reason = self.state.stopped, self.state.stop_reason
        return self.report

    def _run(self) -> None:
        src = self.source
        inline = self.options.finalize == "inline"
        try:
            for row in guarded(src.read_rows(), src.path):
                seq, _ts, kind, _data, _payload = row
                if kind not in ev.INPUT_KINDS:
                    continue
                self.cursor, self.cursor_kind = seq, kind
                if kind in ("background_finalized", "finalize_failed"):
                    scheduled = self.scheduled.pop(seq, None)
                    if scheduled is not None and not inline:
                        self._feed(scheduled[1])  # delivered where RUN received it
                    self.report.recorded_results_skipped += scheduled is None
                    continue
                event = decode(row, src.path)
                try:
                    event = self._admit(event)
                except _Halt as halt:
                    self.report.halted = {
                        "seq": seq,
                        "input_kind": kind,
                        "kind": kind,
                        "data": orjson.loads(row[3]),
                        "reason": halt.reason,
                    }
                    return
                try:
                    self._feed(event)
                except _Halt:
                    raise
                except Exception as err:  # the core refused a recorded input: a divergence, not a crash
                    self.report.halted = {
                        "seq": seq,
                        "input_kind": kind,
                        "kind": kind,
                        "data": orjson.loads(row[3]),
                        "reason": f"the core raised on this input: {type(err).__name__}: {err}",
                    }
                    return
                self.report.inputs_fed += 1
                if self.options.settle_order == "shuffled":
                    self._deliver_some_held()
            for _seq, (_g, result) in sorted(self.scheduled.items()):  # recorded past RUN's end
                self._feed(result)
            self.scheduled.clear()
            while self.held:  # shuffled: the rest, in a seeded random order
                self._feed(self.held.pop(self.rng.randrange(len(self.held))))
        except _Halt as halt:
            # Decided while handling the recorded input at `cursor`: the request nobody can answer.
            self.report.halted = {
                "seq": self.cursor,
                "input_kind": self.cursor_kind,
                "kind": halt.kind,
                "data": halt.data,
                "reason": halt.reason,
            }


def reexecute(source: EventLog, out: str | os.PathLike, options: ReexecOptions) -> ReexecReport:
    return Reexecutor(source, out, options).run()

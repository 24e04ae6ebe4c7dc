"""evolve(state, event): the reducer, the only place the state changes.

One small function per event kind. A fold of the log (`fold`) applies them in order, so the
state after a live run and the state rebuilt from its log are the same object graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.samples import sample_count, split_episode
from orchestrator.core.state import (
    Eval,
    EvalResult,
    Group,
    QueuedSample,
    ShippedSample,
    State,
    Trace,
    initial_state,
    member,
)

_ZERO_OUTPUT_CANCEL_REASONS = ("stale", "overload")


class InconsistentEvent(ValueError):
    """An event that contradicts the state it is folded into: it names a group, episode, trace or
    eval that the state does not hold where the event needs it, or it starts another run. Only a
    damaged log gives one (what this code logs, it logged because the state allowed it); every id
    an event names is checked where a reducer looks it up. A failed lookup of the state's own
    links (an in-flight episode's group, a group's members) is a broken invariant: a bug, raised
    as itself."""


def _missing(what: str, key: object) -> InconsistentEvent:
    return InconsistentEvent(f"{what} {key} is not in the state")


def _run_started(s: State, e: ev.RunStarted) -> None:
    """The state was made for this run by `initial_state(e.params)`: nothing changes."""
    try:
        ev.check_schema_version(e.schema_version)
    except ValueError as err:
        raise InconsistentEvent(str(err)) from None
    if e.params != s.params:
        raise InconsistentEvent("run_started with other params than the state was made for")


def _run_resumed(s: State, e: ev.RunResumed) -> None:
    s.params = s.params.model_copy(update={"max_steps": e.max_steps})
    s.stopped, s.stop_reason, s.draining = False, None, False
    s.finalize_errors.clear()


def _group_dispatched(s: State, e: ev.GroupDispatched) -> None:
    s.groups[e.group_id] = Group(e.group_id, e.env, e.task_id, e.group_size, e.policy_version)
    s.unfilled[e.group_id] = None
    s.next_group_id = e.group_id + 1
    s.rng_counter += 1
    s.cursors[e.env] = e.task_id + 1
    s.grouped_episodes += e.group_size
    s.acct.groups_dispatched += 1


def _episode_dispatched(s: State, e: ev.EpisodeDispatched) -> None:
    episode_id, group_id = e.episode_id, e.group_id
    try:
        group = s.groups[group_id]
    except KeyError:
        raise _missing("group", group_id) from None
    s.inflight[episode_id] = group_id
    group.inflight[episode_id] = None
    group.attempts += 1
    s.next_episode_id = episode_id + 1
    s.acct.dispatched += 1
    if group.needed <= 0:
        s.unfilled.pop(group_id, None)


def _episode_completed(s: State, e: Trace) -> None:
    group_id = s.inflight.pop(e.episode_id, None)
    if group_id is None:  # cancelled (or re-run) while it was finishing: ignored, counted
        s.acct.late += 1
        return
    episode_id, group = e.episode_id, s.groups[group_id]
    del group.inflight[episode_id]
    group.members[episode_id] = None
    s.traces[episode_id] = e
    acct = s.acct
    acct.completed += 1
    acct.completed_samples += len(e.samples) or 1
    acct.completed_tokens += e.n_tokens
    if not e.ok:
        acct.failures += 1


def _episode_cancelled(s: State, e: ev.EpisodeCancelled) -> None:
    try:
        group_id = s.inflight.pop(e.episode_id)
    except KeyError:
        raise _missing("in-flight episode", e.episode_id) from None
    group = s.groups[group_id]
    del group.inflight[e.episode_id]
    if e.reason == "resume":  # lost in a crash: the slot reopens and the episode is re-run
        s.acct.rerun_attempts += 1
        s.unfilled[group.group_id] = None
    else:
        group.cancelled += 1
        s.grouped_episodes -= 1
        s.acct.cancelled_attempts += 1


def _finalize_started(s: State, e: ev.FinalizeStarted) -> None:
    try:
        group = s.groups[e.group_id]
    except KeyError:
        raise _missing("group", e.group_id) from None
    if e.background and not group.background:
        s.finalizing[group.env] = s.finalizing.get(group.env, 0) + 1
        group.background = True
    group.finalizing = True
    group.survivors = list(e.episode_ids)


def _group_finalized(s: State, e: ev.GroupFinalized | ev.BackgroundFinalized) -> None:
    group = s.groups.get(e.group_id)
    if group is None or not group.finalizing:  # cancelled while its grader ran
        s.acct.late += 1
        return
    group.advantages = dict(zip(e.episode_ids, e.advantages))
    group.sample_advantages = dict(getattr(e, "sample_advantages", ()))  # inline results only


def _finalize_failed(s: State, e: ev.FinalizeFailed) -> None:
    if e.group_id in s.groups:
        s.finalize_errors[e.group_id] = e.error


def _forget_group(s: State, group_id: int) -> Group:
    """Remove a settled or cancelled group, giving back its background-finalizing slot."""
    try:
        group = s.groups.pop(group_id)
    except KeyError:
        raise _missing("group", group_id) from None
    s.unfilled.pop(group_id, None)
    s.grouped_episodes -= group.size - group.cancelled
    if group.background:
        s.finalizing[group.env] -= 1
    return group


def _drop_traces(s: State, reason: str, trace_ids: Iterable[int]) -> None:
    """Forget held traces, counting their samples dropped for `reason`."""
    count = 0
    for trace_id in trace_ids:
        try:
            trace = s.traces.pop(trace_id)
        except KeyError:
            raise _missing("held trace", trace_id) from None
        count += sample_count(trace)
    s.acct.drop(reason, count)


def _split_members(s: State, group: Group) -> dict[int, int]:
    """A settling group's several-sample episodes are held as their samples from now on;
    returns how many samples each of them has."""
    counts = {}
    for episode_id in group.members:
        episode = member(s, episode_id)
        if episode.samples:
            del s.traces[episode_id]
            for sample in split_episode(episode):
                s.traces[sample.trace_id] = sample
            counts[episode_id] = len(episode.samples)
    return counts


def _judged_episodes(e: ev.GroupSettled, several_samples: bool) -> int:
    """The settled episodes judged on their content (the dispatch capacity's rate): queued, or
    dropped for any reason but staleness; each once, however many of its samples are listed."""
    judged = [e.sample_ids] + [sample_ids for reason, sample_ids in e.dropped.items() if reason != "stale"]
    if not several_samples:  # every id is its own episode's
        return sum(map(len, judged))
    return len({ev.episode_of(sample_id): None for sample_ids in judged for sample_id in sample_ids})


def _group_settled(s: State, e: ev.GroupSettled) -> None:
    group = _forget_group(s, e.group_id)
    sample_counts = _split_members(s, group)
    per_episode = s.params.sample_weight == "episode" and bool(sample_counts)
    queued_tokens = 0
    for trace_id in e.sample_ids:
        try:
            trace = s.traces[trace_id]
        except KeyError:
            raise _missing("held trace", trace_id) from None
        n_tokens = trace.n_tokens
        s.pending[trace_id] = QueuedSample(
            trace_id,
            group.group_id,
            group.env,
            group.policy_version,
            trace.policy_start,
            n_tokens,
            group.advantage_of(trace_id),
            1.0 / sample_counts.get(ev.episode_of(trace_id), 1) if per_episode else 1.0,
        )
        queued_tokens += n_tokens
    s.pending_tokens += queued_tokens
    acct = s.acct
    acct.queued += len(e.sample_ids)
    acct.queued_tokens += queued_tokens
    acct.judged += _judged_episodes(e, several_samples=bool(sample_counts))
    for reason, trace_ids in e.dropped.items():
        _drop_traces(s, reason, trace_ids)
    if e.admitted:
        s.acct.groups_admitted += 1
        s.acct.zero_output_run = 0
    elif group.finalizing:  # scored, but all-zero advantages: nothing to train on either
        s.acct.groups_rejected += 1
        s.acct.zero_output_run += group.size
    else:
        s.acct.groups_without_output += 1
        s.acct.zero_output_run += group.size


def _group_cancelled(s: State, e: ev.GroupCancelled) -> None:
    group = _forget_group(s, e.group_id)
    _drop_traces(s, e.reason, list(group.members))
    s.acct.groups_cancelled[e.reason] = s.acct.groups_cancelled.get(e.reason, 0) + 1
    if e.reason in _ZERO_OUTPUT_CANCEL_REASONS:
        s.acct.zero_output_run += group.size


def _traces_dropped(s: State, e: ev.TracesDropped) -> None:
    for trace_id in e.trace_ids:
        queued = s.pending.pop(trace_id, None)
        if queued is not None:
            s.pending_tokens -= queued.n_tokens
        else:  # a finished member of an open group (resume): its slot reopens
            try:
                trace = s.traces[trace_id]
            except KeyError:
                raise _missing("held trace", trace_id) from None
            group = s.groups[trace.group_id]
            del group.members[trace_id]
            s.unfilled[group.group_id] = None
    _drop_traces(s, e.reason, e.trace_ids)


def _gate_changed(s: State, e: ev.GateChanged) -> None:
    s.gate_open, s.gate_reason = e.open, e.reason


def _version_published(s: State, e: ev.VersionPublished) -> None:
    s.version = max(s.version, e.version)
    for step in [step for step in s.shipped_batches if step <= s.version]:
        del s.shipped_batches[step]


def _batch_shipped(s: State, e: ev.BatchShipped) -> None:
    samples = []
    for sample_id in e.sample_ids:
        try:
            queued = s.pending.pop(sample_id)
        except KeyError:
            raise _missing("queued sample", sample_id) from None
        s.pending_tokens -= queued.n_tokens
        trace = s.traces.pop(sample_id)
        lag = (e.step - 1) - trace.policy_start
        samples.append(ShippedSample(trace, queued.env, queued.advantage, lag, queued.weight))
    for trace_id in e.pruned_ids:
        try:
            s.pending_tokens -= s.pending.pop(trace_id).n_tokens
        except KeyError:
            raise _missing("queued trace", trace_id) from None
    _drop_traces(s, "zero_advantage", e.pruned_ids)
    s.shipped_batches[e.step] = samples
    s.acct.shipped += len(samples)
    s.acct.shipped_tokens += e.n_tokens
    s.step = e.step + 1
    s.last_reward_mean = e.reward_mean


def _drain_started(s: State, e: ev.DrainStarted) -> None:
    s.draining = True


def _stop_requested(s: State, e: ev.StopRequested) -> None:
    """A request only: `decide` turns it into cancellations and `run_stopped`."""


def _trainer_restarted(s: State, e: ev.TrainerRestarted) -> None:
    """Nothing of the state: the restarted trainer goes on from its checkpoint."""


def _endpoint_changed(s: State, e: ev.EndpointChanged) -> None:
    """Nothing of the state: the client routes around a server that is down."""


def _run_stopped(s: State, e: ev.RunStopped) -> None:
    s.stopped, s.stop_reason = True, e.reason


# --- evaluations: their own state (`State.evals`), never the train accounting --------------------


def _eval_started(s: State, e: ev.EvalStarted) -> None:
    evals = s.evals
    size = len(e.task_ids) * e.samples_per_task
    evals.open[e.eval_id] = Eval(
        e.eval_id, e.env, e.version, list(e.task_ids), e.first_group_id, e.samples_per_task, dict.fromkeys(range(size))
    )
    evals.next_eval_id = e.eval_id + 1
    evals.last_version = e.version
    evals.acct.evals_started += 1
    s.next_group_id = e.first_group_id + len(e.task_ids)  # one group per task, ids shared with train


def _eval_episode_dispatched(s: State, e: ev.EvalEpisodeDispatched) -> None:
    evals = s.evals
    try:
        x = evals.open[e.eval_id]
    except KeyError:
        raise _missing("open eval", e.eval_id) from None
    try:
        del x.to_dispatch[e.sample]
    except KeyError:
        raise _missing(f"eval {e.eval_id}'s undispatched sample", e.sample) from None
    x.inflight[e.episode_id] = e.sample
    x.attempts += 1
    evals.inflight[e.episode_id] = e.eval_id
    evals.acct.dispatched += 1
    s.next_episode_id = e.episode_id + 1  # ids shared with train: one id names one rollout


def _eval_episode_completed(s: State, e: ev.EvalEpisodeCompleted) -> None:
    evals, acct = s.evals, s.evals.acct
    eval_id = evals.inflight.pop(e.episode_id, None)
    if eval_id is None:  # its eval was cancelled, or it was re-run after a crash
        acct.late += 1
        return
    x = evals.open[eval_id]
    sample = x.inflight.pop(e.episode_id)
    acct.completed += 1
    if not e.ok:
        x.failures += 1
        acct.failures += 1
    elif e.policy_start != x.version or e.policy_end != x.version:
        x.off_version += 1
        acct.off_version += 1
    else:
        x.scored[sample] = [e.reward, e.success, e.sampled_tokens]


def _eval_episode_cancelled(s: State, e: ev.EvalEpisodeCancelled) -> None:
    evals = s.evals
    try:
        eval_id = evals.inflight.pop(e.episode_id)
    except KeyError:
        raise _missing("in-flight eval episode", e.episode_id) from None
    x = evals.open[eval_id]
    x.to_dispatch[x.inflight.pop(e.episode_id)] = None  # the sample is taken again if the run goes on
    if e.reason == "resume":
        evals.acct.rerun_attempts += 1
    else:
        evals.acct.cancelled_attempts += 1


def _eval_completed(s: State, e: ev.EvalCompleted) -> None:
    evals = s.evals
    try:
        x = evals.open.pop(e.eval_id)
    except KeyError:
        raise _missing("open eval", e.eval_id) from None
    evals.results.append(
        EvalResult(e.eval_id, e.env, e.version, e.reward_mean, e.pass_at_1, e.pass_at_k, e.k, e.scored, e.tokens)
    )
    evals.acct.reported += len(x.scored)
    evals.acct.evals_completed += 1


_REDUCERS: dict[str, Callable[[State, Any], None]] = {
    "run_started": _run_started,
    "run_resumed": _run_resumed,
    "group_dispatched": _group_dispatched,
    "episode_dispatched": _episode_dispatched,
    "episode_completed": _episode_completed,
    "episode_cancelled": _episode_cancelled,
    "finalize_started": _finalize_started,
    "group_finalized": _group_finalized,
    "background_finalized": _group_finalized,
    "finalize_failed": _finalize_failed,
    "group_settled": _group_settled,
    "group_cancelled": _group_cancelled,
    "traces_dropped": _traces_dropped,
    "gate_changed": _gate_changed,
    "version_published": _version_published,
    "batch_shipped": _batch_shipped,
    "drain_started": _drain_started,
    "stop_requested": _stop_requested,
    "trainer_restarted": _trainer_restarted,
    "endpoint_changed": _endpoint_changed,
    "run_stopped": _run_stopped,
    "eval_started": _eval_started,
    "eval_episode_dispatched": _eval_episode_dispatched,
    "eval_episode_completed": _eval_episode_completed,
    "eval_episode_cancelled": _eval_episode_cancelled,
    "eval_completed": _eval_completed,
}
assert set(_REDUCERS) == set(ev.EVENT_TYPES), "every event kind needs a reducer"


def evolve(state: State, event: ev.Event) -> State:
    """Apply one event to the state (in place) and return it."""
    _REDUCERS[event.kind](state, event)
    return state


class FoldError(ValueError):
    """A logged event the reducer cannot take: one that does not decode (`DECODE_ERRORS`), or
    one that contradicts the state (`InconsistentEvent`, said in the reducer's own words)."""

    def __init__(self, seq: int, kind: str, cause: Exception):
        detail = " ".join(str(cause).split())[:300] or type(cause).__name__
        why = detail if isinstance(cause, InconsistentEvent) else f"{type(cause).__name__}: {detail}"
        super().__init__(f"seq {seq}: cannot fold the {kind!r} event: {why}")
        self.seq, self.kind, self.cause = seq, kind, cause


# What a row of damaged bytes raises as it is decoded: a ValueError (msgspec's DecodeError or
# ValidationError, pydantic's for run_started's params, a payload that does not hold its arrays:
# PayloadError, an unknown kind). Anything else is a bug, raised as itself.
DECODE_ERRORS = ValueError


# seqs -> the payloads of those events (the log's `read_payloads`): how a fold reads the token
# arrays of the traces it still holds at its end, and only those.
PayloadReader = Callable[[list[int]], Mapping[int, bytes]]


def fold_rows(
    state: State | None,
    rows: Iterable[tuple[str, bytes]],
    first_seq: int = 1,
    payloads: PayloadReader | None = None,
    damaged: dict[int, tuple[int, str]] | None = None,
) -> tuple[State | None, int]:
    """Fold logged rows (kind, data JSON), the first one being seq `first_seq`, into `state`, or
    with no state into the state their `run_started` makes; return (the state, how many rows).
    No state and no rows: (None, 0), a log with no event yet.

    Each row is decoded as its event, type-checked, without its token arrays; the traces still
    held at the end get theirs, their payloads read through `payloads` (and checked), so a fold
    costs the arrays of those traces alone. A row that fails raises FoldError; so does a held
    trace whose payload is missing or does not hold its arrays, unless `damaged` is given: a held
    trace never shipped then keeps no arrays and is recorded there (trace id -> its seq and why),
    for the resume that drops it (`RunResumed.damaged_traces`)."""
    reducers, decoders = _REDUCERS, ev.DECODERS
    rows = iter(rows)
    count = 0
    if state is None:
        first = next(rows, None)
        if first is None:
            return None, 0
        kind, data = first
        try:
            first_event = decoders[kind](data) if kind in decoders else None
        except ValueError as err:
            raise FoldError(first_seq, kind, err) from err
        try:
            state = _state_made_by(first_event, kind)
        except InconsistentEvent as err:
            raise FoldError(first_seq, kind, err) from err
        count = 1
    for kind, data in rows:
        decode = decoders.get(kind)
        try:
            if decode is None:
                raise ValueError(f"unknown event kind {kind!r}")
            event: Any = decode(data)  # the event of its kind
        except ValueError as err:  # what a decoder raises for any bytes (msgspec's errors)
            raise FoldError(first_seq + count, kind, err) from err
        if kind == "episode_completed" and event.tokens is not None:
            event.tokens.__dict__["seq"] = first_seq + count  # `arrays.Tokens.seq`
        try:
            reducers[kind](state, event)
        except InconsistentEvent as err:
            raise FoldError(first_seq + count, kind, err) from err
        count += 1
    _read_held_arrays(state, payloads, damaged)
    return state, count


def _state_made_by(first: object, kind: str) -> State:
    """The state of a run whose first event is `first`: it must be its `run_started`."""
    if not isinstance(first, ev.RunStarted):
        raise InconsistentEvent(f"a run's first event is run_started, not {kind!r}")
    return evolve(initial_state(first.params), first)


def evolve_from(state: State | None, event: ev.Event) -> State:
    """`evolve` for a reader that folds a log from its start: with no state yet, the state the
    first event (`run_started`) makes."""
    return _state_made_by(event, event.kind) if state is None else evolve(state, event)


def _read_held_arrays(state: State, payloads: PayloadReader | None, damaged: dict[int, tuple[int, str]] | None) -> None:
    """Give the traces a fold leaves held (queued, or in a batch shipped and not yet trained)
    their token arrays: their rows' payloads, read at once and each checked."""
    held = [(trace_id, unread) for trace_id, t in state.traces.items() if (unread := _unread(t)) is not None]
    shipped = [unread for xs in state.shipped_batches.values() for x in xs if (unread := _unread(x.trace)) is not None]
    wanted = list(dict.fromkeys(seq for _, seq in [unread for _, unread in held] + shipped))
    read = payloads(wanted) if wanted and payloads is not None else {}
    for tokens, seq in [unread for _, unread in held] + shipped:
        tokens.attach(read.get(seq))
    for trace_id, (tokens, seq) in held:
        try:
            _check_arrays(tokens, seq)
        except FoldError as err:
            if damaged is None:
                raise
            damaged[trace_id] = (seq, str(err))
    for tokens, seq in shipped:
        _check_arrays(tokens, seq)


def _unread(trace: Trace) -> tuple[Tokens, int] | None:
    """A trace's tokens and the row whose payload holds their arrays, if this fold decoded it
    and has not read them."""
    tokens = trace.tokens
    if tokens is None or not tokens.n_tokens or tokens.seq is None:
        return None
    return tokens, tokens.seq


def _check_arrays(tokens: Tokens, seq: int) -> None:
    """FoldError naming its row if the payload read for a held trace does not hold its arrays."""
    try:
        tokens.arrays()
    except DECODE_ERRORS as err:
        raise FoldError(seq, "episode_completed", err) from err


def fold(events: Iterable[ev.Event], state: State | None = None) -> State:
    """The state after applying `events` in order, to `state`, or from the state the first
    event (`run_started`) makes."""
    events = iter(events)
    if state is None:
        first = next(events, None)
        state = _state_made_by(first, getattr(first, "kind", "nothing"))
    reducers = _REDUCERS
    for event in events:
        reducers[event.kind](state, event)
    return state

"""The orchestrator state: everything the rules read, rebuilt by folding the log.

Plain dataclasses of ints, lists and insertion-ordered dicts (never sets, so iteration order is
part of the state and identical after a fold). Traces are the logged `EpisodeCompleted` events
themselves (frozen), kept until they ship or are dropped (a fold reads their token arrays only
for those it still holds at its end). A state is whole from the start: `initial_state(params)` is the state of a run
before its `run_started`.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from orchestrator.core.events import (
    SAMPLE_ID_STRIDE,
    CoreParams,
    EpisodeCompleted,
    FinalizeStarted,
    decode_event,
    encode_event,
    episode_of,
)
from orchestrator.core.samples import Sample

# 2: `params` is stored as its own JSON, so env_ratios keeps its order through a snapshot.
# 3: the evals' state (`State.evals`).
# 4: the dispatch capacity's counters (`grouped_episodes`, the admission and token tallies).
# 5: a held trace is its log fields and its packed arrays (base64), not JSON lists.
# 6: several samples per episode: settled episodes are held as their samples; `grouped_episodes`;
# `completed_samples`.
# 7: a held trace is its row (event format 6) and its payload.
REDUCER_VERSION = "orch-core-7"


# A trace: what the state holds of a completed episode until it ships or is dropped, under its
# trace id: the episode while its group is open or finalizing; once the group settled, each of
# its samples (a one-sample episode is its own sample; docs/rules.md, "Words").
Trace = EpisodeCompleted | Sample


@dataclass(slots=True)
class Group:
    group_id: int
    env: str
    task_id: int
    size: int
    policy_version: int  # version when the group was dispatched: the batch cut's sort key
    attempts: int = 0  # episodes ever dispatched into this group
    inflight: dict[int, None] = field(default_factory=dict)  # episode ids (ordered set)
    members: dict[int, None] = field(default_factory=dict)  # completed episode ids kept for scoring
    cancelled: int = 0  # attempts cancelled for good (they count towards completeness)
    finalizing: bool = False
    background: bool = False  # finalizing as a background task (counts towards the cap)
    survivors: list[int] = field(default_factory=list)  # traces being scored
    advantages: dict[int, float] = field(default_factory=dict)  # survivor episode id -> advantage
    sample_advantages: dict[int, float] = field(default_factory=dict)  # sample id -> its agent's advantage

    def advantage_of(self, trace_id: int) -> float:
        """A scored sample's advantage: its agent's, or its episode's."""
        if trace_id in self.sample_advantages:
            return self.sample_advantages[trace_id]
        return self.advantages[trace_id if trace_id < SAMPLE_ID_STRIDE else episode_of(trace_id)]

    @property
    def needed(self) -> int:
        """Members still to dispatch before the group can complete."""
        return self.size - len(self.members) - len(self.inflight) - self.cancelled

    @property
    def complete(self) -> bool:
        return not self.finalizing and not self.inflight and self.needed <= 0


@dataclass(slots=True)
class QueuedSample:
    """A sample in the batch queue (a one-sample episode's sample has the episode's id)."""

    sample_id: int
    group_id: int
    env: str
    dispatch_version: int
    policy_start: int
    n_tokens: int
    advantage: float
    weight: float  # its loss weight (CoreParams.sample_weight)


@dataclass(slots=True)
class ShippedSample:
    """A sample of a shipped batch, kept until the trainer has published that step."""

    trace: Trace
    env: str
    advantage: float
    lag: int
    weight: float


# Every drop reason (`events.DropReason`, `Accounting.dropped`'s keys) with what drives it; None:
# the run's own end (a drain, a stop), which is not waste: the run's settings did not cause it, and
# a resume re-runs the work (docs/observe.md, "Progress").
DROP_REASONS: dict[str, str | None] = {
    "stale": "rollout.max_inflight, rollout.capacity, off_policy.max_off_policy_steps, off_policy.target_lag",
    "rejected": "groups whose rewards all tie (rollout.group_size, the tasks' difficulty)",
    "zero_advantage": "samples with a zero advantage pruned before the cut (batch.constant_trainer_batch_size)",
    "failed": "episodes that failed (each episode_completed's error starts with what failed: inference or env)",
    "no_output": "episodes that sampled no token",
    "overload": "groups cancelled for overload (rollout.max_inflight, rollout.capacity)",
    "damaged": "traces whose token payloads the log lost (a resume with --drop-damaged)",
    "drain": None,
    "stop": None,
}


def wasted_by_reason(acct: Accounting) -> dict[str, int]:
    """Completed samples that will never train, by reason, for any reason but the run's end."""
    return {reason: n for reason, n in acct.dropped.items() if DROP_REASONS[reason] is not None}


def wasted_samples(acct: Accounting) -> int:
    return sum(wasted_by_reason(acct).values())


@dataclass(slots=True)
class Accounting:
    dispatched: int = 0  # episode attempts started
    completed: int = 0  # episode completions accepted (ok or failed)
    completed_samples: int = 0  # their samples (a failed or one-sample episode counts one)
    failures: int = 0  # accepted completions with ok=False
    late: int = 0  # results for episodes or groups no longer waited for (ignored)
    cancelled_attempts: int = 0  # in-flight attempts cancelled (drain, stop, group cancel)
    rerun_attempts: int = 0  # in-flight attempts lost at a crash and re-run on resume
    groups_dispatched: int = 0
    groups_admitted: int = 0
    groups_rejected: int = 0  # scored, but every advantage was zero (curriculum admission)
    groups_without_output: int = 0  # no survivors to score
    groups_cancelled: dict[str, int] = field(default_factory=dict)  # reason -> groups
    shipped: int = 0  # samples shipped to the trainer
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> completed samples never shipped
    zero_output_run: int = 0  # episodes in a row whose groups gave nothing to train on (no survivors,
    # all-zero advantages, or cancelled stale), reset by an admitted group
    completed_tokens: int = 0  # tokens (prompt and completion) of the accepted completions
    shipped_tokens: int = 0  # tokens of the samples shipped
    # The admission rate the dispatch capacity estimates (rule 1): completions of settled
    # groups judged on their content (queued, or dropped as failed, without output, rejected or
    # zero-advantage; not the stale ones, whose age says nothing of the next group's content),
    # and the samples they queued, with their tokens.
    judged: int = 0  # episodes
    queued: int = 0  # samples
    queued_tokens: int = 0

    def drop(self, reason: str, count: int) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + count


@dataclass(slots=True)
class Eval:
    """One open eval: an env at a pinned version. Sample i is of task i // samples_per_task."""

    eval_id: int
    env: str
    version: int
    task_ids: list[int]
    first_group_id: int
    samples_per_task: int
    to_dispatch: dict[int, None] = field(default_factory=dict)  # sample indices (ordered set)
    inflight: dict[int, int] = field(default_factory=dict)  # episode id -> sample index
    attempts: int = 0  # eval episodes ever dispatched
    scored: dict[int, list] = field(default_factory=dict)  # sample -> [reward, success, sampled tokens]
    failures: int = 0
    off_version: int = 0  # samples taken by another version than the pinned one

    @property
    def size(self) -> int:
        return len(self.task_ids) * self.samples_per_task

    @property
    def done(self) -> bool:
        return not self.to_dispatch and not self.inflight


@dataclass(slots=True)
class EvalResult:
    """What `eval_completed` reported, kept for the summaries (one per eval: a few per run)."""

    eval_id: int
    env: str
    version: int
    reward_mean: float | None
    pass_at_1: float | None
    pass_at_k: float | None
    k: int
    scored: int
    tokens: int


@dataclass(slots=True)
class EvalAccounting:
    """Eval episodes, apart from the train accounting."""

    dispatched: int = 0  # eval episode attempts started
    completed: int = 0  # accepted results (scored, failed or off-version)
    failures: int = 0
    off_version: int = 0
    cancelled_attempts: int = 0  # in flight at a stop (taken again if the run is resumed)
    rerun_attempts: int = 0  # in flight at a crash, re-run on resume
    late: int = 0  # results nobody waited for any more (ignored)
    reported: int = 0  # scored samples in a completed eval's figures
    evals_started: int = 0
    evals_completed: int = 0


@dataclass(slots=True)
class EvalState:
    open: dict[int, Eval] = field(default_factory=dict)  # eval id -> eval, oldest first
    inflight: dict[int, int] = field(default_factory=dict)  # episode id -> eval id
    next_eval_id: int = 1
    last_version: int = -1  # version of the newest eval started (-1: none yet)
    results: list[EvalResult] = field(default_factory=list)
    acct: EvalAccounting = field(default_factory=EvalAccounting)


@dataclass(slots=True)
class State:
    params: CoreParams
    step: int = 1  # the next batch to ship
    version: int = 0  # newest version the trainer has published
    next_group_id: int = 1
    next_episode_id: int = 1
    rng_counter: int = 0
    cursors: dict[str, int] = field(default_factory=dict)  # env -> next task index
    groups: dict[int, Group] = field(default_factory=dict)  # open and finalizing groups
    unfilled: dict[int, None] = field(default_factory=dict)  # groups with members to dispatch, in order
    inflight: dict[int, int] = field(default_factory=dict)  # episode id -> group id
    traces: dict[int, Trace] = field(default_factory=dict)  # completed, not shipped nor dropped
    pending: dict[int, QueuedSample] = field(default_factory=dict)  # the batch queue, insertion order
    pending_tokens: int = 0
    finalizing: dict[str, int] = field(default_factory=dict)  # env -> groups finalizing in background
    shipped_batches: dict[int, list[ShippedSample]] = field(default_factory=dict)  # until trained on
    gate_open: bool = False
    gate_reason: str = "not_started"
    draining: bool = False
    stopped: bool = False
    stop_reason: str | None = None
    finalize_errors: dict[int, str] = field(default_factory=dict)  # group id -> error
    last_reward_mean: float | None = None
    # Episodes the open and finalizing groups will still bring (each group's size less its attempts
    # cancelled for good): the dispatch capacity counts them before they are even dispatched.
    grouped_episodes: int = 0
    acct: Accounting = field(default_factory=Accounting)
    evals: EvalState = field(default_factory=EvalState)


def member(s: State, episode_id: int) -> EpisodeCompleted:
    """A completed member of a group not yet settled: held as the episode itself."""
    trace = s.traces[episode_id]
    assert isinstance(trace, EpisodeCompleted), f"group member {episode_id} is held as its samples"
    return trace


def episodes_with_arrays(s: State) -> set[int]:
    """The episodes whose token arrays the state still holds: its traces not yet shipped and the
    samples of the batches shipped and not yet trained on. These, and no others, are the payloads
    a fold of the log reads at its end (`evolve.fold_rows`), so a resume never needs the arrays of
    any other episode logged so far (`log.token_arrays`)."""
    held = {episode_of(trace_id) for trace_id in s.traces}
    held.update(episode_of(x.trace.episode_id) for xs in s.shipped_batches.values() for x in xs)
    return held


def initial_state(params: CoreParams) -> State:
    """The state of a run before its first event, `run_started` (which carries `params`)."""
    return State(params=params, cursors={env: 0 for env in params.env_ratios})


def finalizes_in_background(s: State, started: FinalizeStarted) -> bool:
    """Does a `finalize_started` decision call for a background grader, once every decision of
    its input is applied? Not for a group that a later decision of the same input cancelled (a
    resume that re-finalizes, then drains). The effect interpreter asks this."""
    group = s.groups.get(started.group_id)
    return started.background and group is not None and group.finalizing


def min_fresh_version(params: CoreParams, step: int) -> int:
    """Oldest policy version a sample may start from to train in batch `step`."""
    return (step - 1) - params.max_off_policy_steps


# --- canonical bytes: snapshots and state hashes -------------------------------------------------


def _group_to_dict(g: Group) -> dict[str, Any]:
    return {
        "group_id": g.group_id,
        "env": g.env,
        "task_id": g.task_id,
        "size": g.size,
        "policy_version": g.policy_version,
        "attempts": g.attempts,
        "inflight": list(g.inflight),
        "members": list(g.members),
        "cancelled": g.cancelled,
        "finalizing": g.finalizing,
        "background": g.background,
        "survivors": g.survivors,
        "advantages": [[k, v] for k, v in g.advantages.items()],
        "sample_advantages": [[k, v] for k, v in g.sample_advantages.items()],
    }


def _group_from_dict(d: dict[str, Any]) -> Group:
    return Group(
        group_id=d["group_id"],
        env=d["env"],
        task_id=d["task_id"],
        size=d["size"],
        policy_version=d["policy_version"],
        attempts=d["attempts"],
        inflight=dict.fromkeys(d["inflight"]),
        members=dict.fromkeys(d["members"]),
        cancelled=d["cancelled"],
        finalizing=d["finalizing"],
        background=d["background"],
        survivors=d["survivors"],
        advantages={k: v for k, v in d["advantages"]},
        sample_advantages={k: v for k, v in d["sample_advantages"]},
    )


def _trace_dict(t: Trace) -> list[str]:
    """A held trace in a snapshot: what it is, its fields as JSON and its payload in base64."""
    payload: bytes | None
    if isinstance(t, Sample):
        data, payload = _SAMPLE_ENCODER.encode(t), t.tokens.packed()
    else:
        _kind, data, payload = encode_event(t)
    return [type(t).__name__, data.decode(), base64.b64encode(payload or b"").decode()]


def _trace_from_dict(d: list[str]) -> Trace:
    what, data, payload = d
    if what == "Sample":
        sample = _decode_sample(data)
        sample.tokens.attach(base64.b64decode(payload))
        sample.tokens.arrays()  # checked now, as an episode's are: PayloadError
        return sample
    return decode_event("episode_completed", data, base64.b64decode(payload))  # type: ignore[return-value]


_SAMPLE_ENCODER = msgspec.json.Encoder()
_decode_sample = msgspec.json.Decoder(Sample).decode


def _evals_to_dict(e: EvalState) -> dict:
    return {
        "open": [
            [
                x.eval_id,
                x.env,
                x.version,
                x.task_ids,
                x.first_group_id,
                x.samples_per_task,
                list(x.to_dispatch),
                [[k, v] for k, v in x.inflight.items()],
                x.attempts,
                [[k, v] for k, v in x.scored.items()],
                x.failures,
                x.off_version,
            ]
            for x in e.open.values()
        ],
        "inflight": [[k, v] for k, v in e.inflight.items()],
        "next_eval_id": e.next_eval_id,
        "last_version": e.last_version,
        "results": [[getattr(r, n) for n in EvalResult.__slots__] for r in e.results],
        "acct": {name: getattr(e.acct, name) for name in EvalAccounting.__slots__},
    }


def _evals_from_dict(d: dict) -> EvalState:
    open_evals = {}
    for (
        eval_id,
        env,
        version,
        task_ids,
        first_group_id,
        samples_per_task,
        to_dispatch,
        inflight,
        attempts,
        scored,
        failures,
        off_version,
    ) in d["open"]:
        open_evals[eval_id] = Eval(
            eval_id,
            env,
            version,
            task_ids,
            first_group_id,
            samples_per_task,
            dict.fromkeys(to_dispatch),
            {k: v for k, v in inflight},
            attempts,
            {k: v for k, v in scored},
            failures,
            off_version,
        )
    return EvalState(
        open=open_evals,
        inflight={k: v for k, v in d["inflight"]},
        next_eval_id=d["next_eval_id"],
        last_version=d["last_version"],
        results=[EvalResult(*r) for r in d["results"]],
        acct=EvalAccounting(**d["acct"]),
    )


def state_to_dict(s: State) -> dict[str, Any]:
    acct = s.acct
    return {
        "reducer_version": REDUCER_VERSION,
        # As its own JSON text, so the sorted keys of the snapshot leave its dicts in their
        # order: the env choice walks env_ratios in the order the run was started with.
        "params": s.params.model_dump_json(),
        "step": s.step,
        "version": s.version,
        "next_group_id": s.next_group_id,
        "next_episode_id": s.next_episode_id,
        "rng_counter": s.rng_counter,
        "cursors": s.cursors,
        "groups": [_group_to_dict(g) for g in s.groups.values()],
        "unfilled": list(s.unfilled),
        "inflight": [[e, g] for e, g in s.inflight.items()],
        "traces": [_trace_dict(t) for t in s.traces.values()],
        "pending": [
            [q.sample_id, q.group_id, q.env, q.dispatch_version, q.policy_start, q.n_tokens, q.advantage, q.weight]
            for q in s.pending.values()
        ],
        "pending_tokens": s.pending_tokens,
        "finalizing": s.finalizing,
        "shipped_batches": [
            [step, [[_trace_dict(x.trace), x.env, x.advantage, x.lag, x.weight] for x in samples]]
            for step, samples in s.shipped_batches.items()
        ],
        "gate_open": s.gate_open,
        "gate_reason": s.gate_reason,
        "draining": s.draining,
        "stopped": s.stopped,
        "stop_reason": s.stop_reason,
        "finalize_errors": [[g, e] for g, e in s.finalize_errors.items()],
        "last_reward_mean": s.last_reward_mean,
        "grouped_episodes": s.grouped_episodes,
        "acct": {name: getattr(acct, name) for name in Accounting.__slots__},
        "evals": _evals_to_dict(s.evals),
    }


def state_from_dict(d: dict[str, Any]) -> State:
    if d.get("reducer_version") != REDUCER_VERSION:
        raise ValueError(f"state from reducer {d.get('reducer_version')!r}, this code is {REDUCER_VERSION}")
    return State(
        params=CoreParams.model_validate_json(d["params"]),
        step=d["step"],
        version=d["version"],
        next_group_id=d["next_group_id"],
        next_episode_id=d["next_episode_id"],
        rng_counter=d["rng_counter"],
        cursors=d["cursors"],
        groups={g["group_id"]: _group_from_dict(g) for g in d["groups"]},
        unfilled=dict.fromkeys(d["unfilled"]),
        inflight={e: g for e, g in d["inflight"]},
        traces={t.trace_id: t for t in map(_trace_from_dict, d["traces"])},
        pending={q[0]: QueuedSample(*q) for q in d["pending"]},
        pending_tokens=d["pending_tokens"],
        finalizing=d["finalizing"],
        shipped_batches={
            step: [ShippedSample(_trace_from_dict(t), env, adv, lag, weight) for t, env, adv, lag, weight in samples]
            for step, samples in d["shipped_batches"]
        },
        gate_open=d["gate_open"],
        gate_reason=d["gate_reason"],
        draining=d["draining"],
        stopped=d["stopped"],
        stop_reason=d["stop_reason"],
        finalize_errors={g: e for g, e in d["finalize_errors"]},
        last_reward_mean=d["last_reward_mean"],
        grouped_episodes=d["grouped_episodes"],
        acct=Accounting(**d["acct"]),
        evals=_evals_from_dict(d["evals"]),
    )


def state_bytes(s: State) -> bytes:
    """Canonical bytes of the state (sorted keys): snapshots store them, hashes compare them."""
    return orjson.dumps(state_to_dict(s), option=orjson.OPT_SORT_KEYS)


def state_from_bytes(data: bytes) -> State:
    return state_from_dict(orjson.loads(data))


def state_hash(s: State) -> str:
    return hashlib.sha256(state_bytes(s)).hexdigest()


def conservation(s: State) -> tuple[bool, dict[str, int]]:
    """The conservation law, in samples: every sample of an accepted completion is shipped,
    pending, held by an open or finalizing group, or accounted as dropped, once. Returns (holds,
    the terms)."""
    members = [s.traces[t] for g in s.groups.values() for t in g.members]
    terms = {
        "completed": s.acct.completed_samples,
        "shipped": s.acct.shipped,
        "pending": len(s.pending),
        "in_groups": sum(len(t.samples) or 1 for t in members),
        "dropped": sum(s.acct.dropped.values()),
    }
    accounted = terms["shipped"] + terms["pending"] + terms["in_groups"] + terms["dropped"]
    # Every held trace must still be in `traces` (pending, grouped) or in a shipped batch.
    holds = accounted == terms["completed"] and len(s.traces) == len(s.pending) + len(members)
    if s.params.eval is not None:
        eval_holds, eval_terms = eval_conservation(s.evals)
        holds = holds and eval_holds
        terms.update(eval_terms)
    return holds, terms


def eval_conservation(e: EvalState) -> tuple[bool, dict[str, int]]:
    """The evals' own terms: every eval attempt dispatched is in flight, completed, cancelled or
    re-run; every scored completion is held by an open eval or reported by a completed one."""
    a = e.acct
    terms = {
        "eval_dispatched": a.dispatched,
        "eval_completed": a.completed,
        "eval_inflight": len(e.inflight),
        "eval_cancelled": a.cancelled_attempts,
        "eval_rerun": a.rerun_attempts,
        "eval_failures": a.failures,
        "eval_off_version": a.off_version,
        "eval_held": sum(len(x.scored) for x in e.open.values()),
        "eval_reported": a.reported,
    }
    attempts = terms["eval_completed"] + terms["eval_inflight"] + terms["eval_cancelled"] + terms["eval_rerun"]
    scored = terms["eval_completed"] - terms["eval_failures"] - terms["eval_off_version"]
    holds = (
        attempts == terms["eval_dispatched"]
        and scored == terms["eval_held"] + terms["eval_reported"]
        and len(e.inflight) == sum(len(x.inflight) for x in e.open.values())
    )
    return holds, terms

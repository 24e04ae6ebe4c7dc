"""decide(state, input) -> decisions: the rules of docs/rules.md, one small function per rule.

`decide` folds the input and every decision it emits into `state` through `evolve` as it goes, so
a later rule sees what an earlier one decided; the state changes only in `evolve`. The logged
stream is `[input, *decisions]`, and folding it from the previous state gives the same state.

Order for every input: evolve the input; the input's own rule, which ends with the common tail
when it changed anything the tail reads: ship what is ready and released (rules 6-7), re-check
the gate and refill free permits (rule 1), finish a drain (rule 9); with the dispatch capacity
on, the tail re-checks and refills before the ship as well (see `common_tail`). A completion
refills its permit *before* its group is finalized: that makes inline and background
finalization dispatch the same episodes at the same points, so both ship identical batches
(docs/rules.md, 2. Completion).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from orchestrator.core import events as ev
from orchestrator.core.advantages import INLINE_SCORERS, InlineScorer
from orchestrator.core.batch import batch_sha256, encode_batch, sample_of
from orchestrator.core.evals import (
    accepted_eval_result,
    cancel_eval_episodes,
    evals_pending,
    on_eval_result,
    run_evals,
)
from orchestrator.core.evolve import evolve
from orchestrator.core.rng import choose_by_ratio, uniform
from orchestrator.core.samples import Sample, seat_of, split_episode, trainable_starts
from orchestrator.core.state import Group, QueuedSample, State, member, min_fresh_version


class _Decisions:
    """Collects decisions, folding each into the state at once."""

    __slots__ = ("state", "events", "batch_payloads")

    def __init__(self, state: State, batch_payloads: dict[int, bytes] | None):
        self.state = state
        self.events: list = []
        self.batch_payloads = batch_payloads

    def emit(self, event) -> None:
        evolve(self.state, event)
        self.events.append(event)


def decide(state: State, event, batch_payloads: dict[int, bytes] | None = None) -> list:
    """Fold the input `event` into `state` and return the decisions it calls for (already folded).

    `batch_payloads`, if given, receives the batch file of every batch shipped (step -> the bytes
    its sha256 covers), so the shell writes them without encoding them again."""
    rule = _INPUT_RULES.get(event.kind)
    if rule is None:
        raise ValueError(f"{event.kind!r} is a decision, not an input")
    accepted = _accepted(state, event)
    evolve(state, event)
    d = _Decisions(state, batch_payloads)
    if accepted and not state.stopped:
        rule(d, event)
    return d.events


def _accepted(s: State, e) -> bool:
    """False for results nobody waits for any more (late completions, cancelled groups). A
    completion naming another group than the one its episode was dispatched into is refused:
    the trace would be filed under one group and judged under the other."""
    if e.kind == "episode_completed":
        group_id = s.inflight.get(e.episode_id)
        if group_id is not None and group_id != e.group_id:
            raise ValueError(
                f"episode {e.episode_id} completed for group {e.group_id}, but it was dispatched into group {group_id}"
            )
        return group_id is not None
    if e.kind == "background_finalized":
        group = s.groups.get(e.group_id)
        return group is not None and group.finalizing
    if e.kind == "eval_episode_completed":
        return accepted_eval_result(s, e)
    return True


def refill(d: _Decisions) -> None:
    update_dispatch_gate(d)
    dispatch_train_episodes(d)


def common_tail(d: _Decisions) -> None:
    """What every rule ends with once it changed something the shipping rules read.

    With the dispatch capacity on, the permits are refilled before the ship too: a batch that
    was ready before its hold released ships at the publish that releases it and advances the
    step past target_lag, closing the gate; the capacity that publish freed would then wait a
    whole trainer step, and the next batch with it. Before the ship the gate is open, and what
    it dispatches trains one step later, within max_off_policy_steps (the capacity counts it)."""
    if d.state.stopped:
        return
    if d.state.params.capacity == "staleness":
        refill(d)
    ship_ready_batches(d)
    refill(d)
    run_evals(d)  # outside the train gate (rule 1's eval traffic)
    finish_drain(d)


# --- rule 1: dispatch ----------------------------------------------------------------------------


def dispatch_gate(s: State) -> tuple[bool, str]:
    """Is train dispatch allowed, and why (not)."""
    p = s.params
    if s.draining or s.stopped:
        return False, "draining"
    if (s.step - 1) - s.version > p.target_lag:
        return False, "off_policy_lag"
    if s.finalizing and max(s.finalizing.values()) >= p.max_finalizing_groups:
        return False, "finalizing_cap"
    if p.capacity == "staleness" and not capacity_has_room(s):
        return False, "capacity"
    return True, "open"


def capacity_has_room(s: State) -> bool:
    """Rule 1 (d): may a new group start, or would the work already dispatched and not yet
    shipped or dropped fill every step that could still train a sample dispatched now?

    A sample dispatched at version v trains at the latest in step v + max_off_policy_steps + 1,
    so the steps from `step` to that one (none past max_steps) can take `accepting` batches
    more. Against them count, in batch units (samples, or tokens with `token_batch_size`), the
    queue as it stands and every sample the open and finalizing groups will still bring
    (`grouped_episodes`: in flight, completed, and not yet dispatched), the latter at the units a
    settled completion turned out to bring the queue so far: queued units over completions
    judged on their content. That
    rate over-provisions for rejected groups, failures and settle-time pruning, and it is a
    ratio of integer counters, so the decision is exact and deterministic. Its prior, one batch
    of `batch_size` samples that filled one batch, sets the start (full admission; in tokens,
    `token_batch_size` over `batch_size` per sample) and fades as groups settle.

    There is room while at least one more sample is expected to be needed: a group may then
    overshoot by less than its size, and an admission rate just short of one does not start a
    group whose samples would all be surplus. With no group open and less than a batch queued
    there is always room, so the rule cannot stall a run (groups already started are dispatched
    in full either way); with no step left to accept a sample (a lag beyond
    max_off_policy_steps) there is none, and the batch in training will publish a version.
    Starting a group re-checks the gate at once; every other rule that changes what this reads
    (step, version, the queue, groups settled or cancelled) ends by re-checking it."""
    if trainer_keeps_up(s):
        return True
    p, acct = s.params, s.acct
    accepting = min(p.max_off_policy_steps + 1 - ((s.step - 1) - s.version), p.max_steps + 1 - s.step)
    if accepting <= 0:
        return False
    if p.token_batch_size is None:
        per_step, pending, queued_units = p.batch_size, len(s.pending), acct.queued
    else:
        per_step, pending, queued_units = p.token_batch_size, s.pending_tokens, acct.queued_tokens
    if not s.grouped_episodes and pending < per_step:
        return True
    units = queued_units + per_step  # queued units per judged completion is units / judged
    judged = acct.judged + p.batch_size
    return pending * judged + (s.grouped_episodes + 1) * units <= accepting * per_step * judged


def trainer_keeps_up(s: State) -> bool:
    """Rule 1 (d): the trainer has trained every batch shipped and nothing waits in the queue for
    it, though the ship hold would let a batch wait (`target_lag` >= 1: a trainer-bound run always
    has one waiting; with 0 the hold itself idles the trainer, which then tells nothing). Read
    after the trainer's first step: a run's start says nothing yet of which side is the slower.
    Generation is then the bound, and the capacity does not throttle it: `max_inflight` alone
    caps dispatch. Ships, publishes and settles, which change this, re-check the gate."""
    return s.params.target_lag >= 1 and s.version >= 1 and s.version >= s.step - 1 and not s.pending


def update_dispatch_gate(d: _Decisions) -> None:
    s = d.state
    is_open, reason = dispatch_gate(s)
    if (is_open, reason) != (s.gate_open, s.gate_reason):
        d.emit(ev.GateChanged(open=is_open, reason=reason))


def dispatch_train_episodes(d: _Decisions) -> None:
    """Fill free permits: unfilled groups first (oldest first, so a resumed group's missing
    members go before anything newer), then new groups, while the gate is open. A gate closed
    by the capacity alone holds back new groups only: a started group's size was counted when
    it started, and a group left half-dispatched would never complete."""
    s = d.state
    max_inflight = s.params.max_inflight
    while len(s.inflight) < max_inflight:
        if s.unfilled and (s.gate_open or s.gate_reason == "capacity"):
            group_id = min(s.unfilled)
        elif s.gate_open:
            group_id = start_train_group(d)
        else:
            return
        group = s.groups[group_id]
        d.emit(
            ev.EpisodeDispatched(
                episode_id=s.next_episode_id,
                group_id=group_id,
                attempt=group.attempts,
                policy_version=s.version,
            )
        )


def start_train_group(d: _Decisions) -> int:
    """Choose an env by ratio with the seeded RNG and take its sampler's next task."""
    s, p = d.state, d.state.params
    env = choose_by_ratio(p.env_ratios, uniform(p.seed, s.rng_counter))
    group_id = s.next_group_id
    d.emit(
        ev.GroupDispatched(
            group_id=group_id,
            env=env,
            task_id=s.cursors[env],
            group_size=p.group_size,
            policy_version=s.version,
        )
    )
    if p.capacity == "staleness":  # the new group's samples count against the capacity now
        update_dispatch_gate(d)
    return group_id


# --- rules 2-4: completion, finalize, settle -----------------------------------------------------


def on_episode_completed(d: _Decisions, e: ev.EpisodeCompleted) -> None:
    # The freed permit is refilled at once. The gate needs no re-check: a completion changes
    # nothing it reads (step, version, background-finalizing counts, draining, stopped, and the
    # capacity's queue, grouped samples and admission counters: a completed member stays in its
    # group), and every rule that does change one of those ends by re-checking it.
    dispatch_train_episodes(d)
    group = d.state.groups[e.group_id]
    if group.complete:
        finalize_group(d, group)
        common_tail(d)
    # else: only a permit changed hands, which refill settled; the tail would find nothing to do


def survivors_of(s: State, group: Group) -> list[int]:
    """Ok episodes with a sample that has a sampled token and is still fresh enough to train."""
    oldest = min_fresh_version(s.params, s.step)
    survivors = []
    for episode_id in group.members:
        episode = member(s, episode_id)
        if episode.ok and could_train(episode, oldest):
            survivors.append(episode_id)
    return survivors


def could_train(trace: ev.EpisodeCompleted, oldest: int) -> bool:
    """Rule 5 for an episode: has it a sample with sampled tokens whose oldest token is at least
    `oldest`? (Each sample is judged by its own oldest token.)"""
    if not trace.samples:  # one sample: the episode's own fields say it
        return trace.sampled_tokens > 0 and trace.policy_start >= oldest
    return any(start >= oldest for start in trainable_starts(trace))


def finalize_group(d: _Decisions, group: Group) -> None:
    s, p = d.state, d.state.params
    survivors = survivors_of(s, group)
    if not survivors:
        settle_group(d, group)
        return
    d.emit(
        ev.FinalizeStarted(
            group_id=group.group_id,
            background=p.finalize_in_background,
            episode_ids=survivors,
        )
    )
    if p.finalize_in_background:
        return  # the shell scores it; the result comes back as a `background_finalized` input
    scorer = INLINE_SCORERS[p.algorithm]
    rewards = [s.traces[trace_id].reward for trace_id in survivors]
    d.emit(
        ev.GroupFinalized(
            group_id=group.group_id,
            episode_ids=survivors,
            advantages=scorer(rewards, p),
            sample_advantages=score_agents_apart(s, survivors, scorer),
        )
    )
    settle_group(d, group)


def score_agents_apart(s: State, survivors: list[int], scorer: InlineScorer) -> list[tuple[int, float]]:
    """Rule 3 for episodes whose env scored each agent (`agent_rewards`): each agent's samples
    take the advantage of that agent's reward among the rewards of the same seat across the group
    (`seat_of`: the traces one seat played in an episode, `seat#k`, share its pool); empty where
    no episode has agent rewards."""
    pools: dict[str, list[tuple[tuple[int, str], float]]] = {}
    for trace_id in survivors:
        for agent, reward in member(s, trace_id).agent_rewards:
            pools.setdefault(seat_of(agent), []).append(((trace_id, agent), reward))
    if not pools:
        return []
    scored: dict[tuple[int, str], float] = {}
    for pool in pools.values():
        advantages = scorer([reward for _, reward in pool], s.params)
        scored.update((key, advantage) for (key, _), advantage in zip(pool, advantages))
    return [
        (sample.trace_id, scored[trace_id, sample.agent])
        for trace_id in survivors
        if member(s, trace_id).agent_rewards
        for sample in split_episode(member(s, trace_id))
        if isinstance(sample, Sample) and sample.agent is not None
    ]


def on_background_finalized(d: _Decisions, e: ev.BackgroundFinalized) -> None:
    settle_group(d, d.state.groups[e.group_id])
    common_tail(d)


def _drop_reason(s: State, trace_id: int) -> ev.DropReason:
    trace = s.traces[trace_id]
    if not trace.ok:
        return "failed"
    if trace.sampled_tokens == 0:
        return "no_output"
    return "stale"


def survivor_samples(trace: ev.EpisodeCompleted) -> list[tuple[int, int, int]]:
    """(sample id, oldest version, sampled tokens) of each sample of a survivor."""
    if not trace.samples:  # its one sample has sampled tokens, or it would not have survived
        return [(trace.episode_id, trace.policy_start, 1)]
    return [(sample.trace_id, sample.policy_start, sample.sampled_tokens) for sample in split_episode(trace)]


def sample_ids(trace: ev.EpisodeCompleted) -> list[int]:
    if not trace.samples:
        return [trace.episode_id]
    return [sample.trace_id for sample in split_episode(trace)]


def settle_group(d: _Decisions, group: Group) -> None:
    """One body for both paths: admission, pruning, insertion stale sweep, queue insert. The
    group is judged by its episodes; what it queues or drops are their samples, each by its own
    sampled tokens and oldest version (docs/rules.md, "Samples")."""
    s, p = d.state, d.state.params
    survivors = group.survivors if group.finalizing else []
    scored = dict.fromkeys(survivors)
    dropped: dict[ev.DropReason, list[int]] = {}
    for episode_id in group.members:
        if episode_id not in scored:
            dropped.setdefault(_drop_reason(s, episode_id), []).extend(sample_ids(member(s, episode_id)))
    parts = [part for episode_id in survivors for part in survivor_samples(member(s, episode_id))]
    admitted = any(group.advantage_of(trace_id) != 0.0 for trace_id, _, _ in parts)
    inserted: list[int] = []
    if survivors and not admitted:
        dropped["rejected"] = [trace_id for trace_id, _, _ in parts]
    oldest = min_fresh_version(p, s.step)
    for trace_id, policy_start, sampled_tokens in parts if admitted else ():
        if not sampled_tokens:
            dropped.setdefault("no_output", []).append(trace_id)
        elif p.constant_trainer_batch_size and group.advantage_of(trace_id) == 0.0:
            dropped.setdefault("zero_advantage", []).append(trace_id)
        elif policy_start < oldest:
            dropped.setdefault("stale", []).append(trace_id)
        else:
            inserted.append(trace_id)
    d.emit(
        ev.GroupSettled(
            group_id=group.group_id,
            admitted=admitted,
            sample_ids=inserted,
            dropped=dropped,
        )
    )
    stop_if_zero_output(d)


def stop_if_zero_output(d: _Decisions) -> None:
    """Rule 3's guard: `zero_output_batches` batch-equivalents in a row with nothing to train on."""
    s, p = d.state, d.state.params
    if s.acct.zero_output_run >= p.zero_output_batches * p.batch_size:
        stop_run(d, "zero_output", error=True)


# --- rule 5: staleness ---------------------------------------------------------------------------


def sweep_stale_pending(d: _Decisions) -> None:
    s = d.state
    oldest = min_fresh_version(s.params, s.step)
    stale = [q.sample_id for q in s.pending.values() if q.policy_start < oldest]
    if stale:
        d.emit(ev.TracesDropped(trace_ids=stale, reason="stale"))


def cancel_stale_finalizing(d: _Decisions) -> None:
    """Cancel background-finalizing groups none of whose survivors could still be inserted."""
    s = d.state
    oldest = min_fresh_version(s.params, s.step)
    for group in [g for g in s.groups.values() if g.background]:
        if not any(could_train(member(s, t), oldest) for t in group.survivors):
            d.emit(
                ev.GroupCancelled(
                    group_id=group.group_id,
                    reason="stale",
                    count=len(group.members),
                )
            )
            stop_if_zero_output(d)
            if s.stopped:
                return


# --- rules 6-8: batch cut, ship hold, version publish --------------------------------------------


def batch_ready(s: State) -> bool:
    p = s.params
    if p.token_batch_size is not None:
        return s.pending_tokens >= p.token_batch_size
    return len(s.pending) >= p.batch_size


def ship_hold_released(s: State) -> bool:
    """Batch N ships only once the trainer has published version >= N-1-target_lag."""
    return s.version >= s.step - 1 - s.params.target_lag


def cut_batch(s: State) -> tuple[list[QueuedSample], list[QueuedSample]]:
    """Rule 6: the oldest samples of the queue (a stable sort, so a group's samples stay next
    to each other): (shipped, pruned). `batch_cut` says where the batch ends: at `batch_size`
    samples, or with the last whole group that fits (`groups`: a group's samples never split
    across batches; a group larger than a batch ships alone). With `token_batch_size`, the
    same in tokens."""
    p = s.params
    ordered = sorted(s.pending.values(), key=lambda q: q.dispatch_version)
    if p.batch_cut == "groups":
        in_tokens = p.token_batch_size is not None
        taken = whole_groups_that_fit(ordered, p.token_batch_size or p.batch_size, in_tokens)
    elif p.token_batch_size is None:
        taken = ordered[: p.batch_size]
    else:
        taken, tokens = [], 0
        for queued in ordered:
            if taken and tokens + queued.n_tokens > p.token_batch_size:
                break
            taken.append(queued)
            tokens += queued.n_tokens
    if p.constant_trainer_batch_size:
        return taken, []
    return [q for q in taken if q.advantage != 0.0], [q for q in taken if q.advantage == 0.0]


def whole_groups_that_fit(ordered: list[QueuedSample], limit: int, in_tokens: bool) -> list[QueuedSample]:
    """The oldest whole groups of `ordered` (each group's samples next to each other) that
    together hold at most `limit` samples (`in_tokens`: tokens); at least the first group."""
    taken: list[QueuedSample] = []
    size = start = 0
    while start < len(ordered):
        end = start + 1
        while end < len(ordered) and ordered[end].group_id == ordered[start].group_id:
            end += 1
        group = ordered[start:end]
        group_size = sum(q.n_tokens for q in group) if in_tokens else len(group)
        if taken and size + group_size > limit:
            break
        taken.extend(group)
        size += group_size
        start = end
    return taken


def ship_ready_batches(d: _Decisions) -> None:
    s = d.state
    while s.step <= s.params.max_steps and batch_ready(s) and ship_hold_released(s):
        ship_batch(d)
        on_step_advanced(d)
        if s.stopped:
            return


def ship_batch(d: _Decisions) -> None:
    s = d.state
    shipped, pruned = cut_batch(s)
    step = s.step
    records, lags, rewards, n_tokens = [], [], [], 0
    for queued in shipped:
        trace = s.traces[queued.sample_id]
        lag = (step - 1) - trace.policy_start
        records.append(sample_of(trace, queued.env, queued.advantage, lag, queued.weight))
        lags.append(lag)
        rewards.append(trace.reward)
        n_tokens += queued.n_tokens
    payload = encode_batch(step, records)
    if d.batch_payloads is not None:
        d.batch_payloads[step] = payload
    d.emit(
        ev.BatchShipped(
            step=step,
            sample_ids=[q.sample_id for q in shipped],
            pruned_ids=[q.sample_id for q in pruned],
            sha256=batch_sha256(payload),
            n_tokens=n_tokens,
            off_policy_max=max(lags, default=0),
            off_policy_mean=sum(lags) / len(lags) if lags else 0.0,
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
        )
    )


def on_step_advanced(d: _Decisions) -> None:
    sweep_stale_pending(d)
    cancel_stale_finalizing(d)
    if d.state.step > d.state.params.max_steps and not d.state.stopped:
        start_drain(d)


def on_version_published(d: _Decisions, e: ev.VersionPublished) -> None:
    """Rule 8: the version already advanced in evolve; ship what the hold released."""
    common_tail(d)


# --- rule 9: drain and stop ----------------------------------------------------------------------


def cancel_everything(d: _Decisions, reason: Literal["drain", "stop"]) -> None:
    """Cancel in-flight episodes, open and finalizing groups, and the queue; wait for none."""
    s = d.state
    for episode_id in list(s.inflight):
        d.emit(ev.EpisodeCancelled(episode_id=episode_id, reason=reason))
    for group in list(s.groups.values()):
        d.emit(
            ev.GroupCancelled(
                group_id=group.group_id,
                reason=reason,
                count=len(group.members),
            )
        )
    if s.pending:
        d.emit(ev.TracesDropped(trace_ids=list(s.pending), reason=reason))


def start_drain(d: _Decisions) -> None:
    """At max_steps: stop dispatch and cancel work whose batches would be dropped anyway."""
    d.emit(ev.DrainStarted(reason="max_steps"))
    cancel_everything(d, "drain")
    update_dispatch_gate(d)


def finish_drain(d: _Decisions) -> None:
    """Stop once the trainer has trained on the last batch shipped (the ship hold saw it coming)
    and the evals still owed, the end's included, have reported (docs/evals.md). That is batch
    max_steps, unless a resume lowered max_steps below what had already shipped."""
    s = d.state
    if s.draining and not s.stopped and s.version >= s.step - 1 and not evals_pending(s):
        d.emit(ev.RunStopped(reason="completed"))


def stop_run(d: _Decisions, reason: str, error: bool = False) -> None:
    s = d.state
    if not s.draining:
        d.emit(ev.DrainStarted(reason=reason))
    cancel_everything(d, "stop")
    cancel_eval_episodes(d, "stop")
    update_dispatch_gate(d)
    d.emit(ev.RunStopped(reason=reason, error=error))


def on_stop_requested(d: _Decisions, e: ev.StopRequested) -> None:
    stop_run(d, e.reason)


# --- rule 10: resume -----------------------------------------------------------------------------


def on_run_resumed(d: _Decisions, e: ev.RunResumed) -> None:
    """Re-run lost episodes, drop the traces whose payloads were lost, keep fresh members,
    re-finalize, sweep the queue."""
    s = d.state
    for episode_id in list(s.inflight):
        d.emit(ev.EpisodeCancelled(episode_id=episode_id, reason="resume"))
    cancel_eval_episodes(d, "resume")
    drop_damaged_traces(d, e.damaged_traces)
    oldest = min_fresh_version(s.params, s.step)
    stale_members = [
        trace_id
        for group in s.groups.values()
        if not group.finalizing
        for trace_id in group.members
        if max(trainable_starts(member(s, trace_id)), default=member(s, trace_id).policy_start) < oldest
    ]
    if stale_members:
        d.emit(ev.TracesDropped(trace_ids=stale_members, reason="stale"))
    for group in [g for g in s.groups.values() if g.finalizing]:
        d.emit(
            ev.FinalizeStarted(
                group_id=group.group_id,
                background=True,
                episode_ids=group.survivors,
            )
        )
    sweep_stale_pending(d)
    cancel_stale_finalizing(d)
    if s.step > s.params.max_steps and not s.stopped:
        start_drain(d)
    common_tail(d)


def drop_damaged_traces(d: _Decisions, trace_ids: list[int]) -> None:
    """Rule 10 (`--drop-damaged`): held traces whose payloads are lost never train. A queued one
    or a finished member of an open group is dropped (the member's slot reopens and is re-run);
    a group being finalized is cancelled whole, since its scores were computed with the lost one."""
    s = d.state
    damaged = set(trace_ids)
    finalizing = sorted(
        {s.traces[t].group_id for t in trace_ids if s.traces[t].group_id in s.groups}
        & {g.group_id for g in s.groups.values() if g.finalizing}
    )
    for group_id in finalizing:
        group = s.groups[group_id]
        damaged.difference_update(group.members)
        d.emit(ev.GroupCancelled(group_id=group_id, reason="damaged", count=len(group.members)))
    rest = [t for t in trace_ids if t in damaged]
    if rest:
        d.emit(ev.TracesDropped(trace_ids=rest, reason="damaged"))


def on_run_started(d: _Decisions, e: ev.RunStarted) -> None:
    common_tail(d)


def on_eval_episode_completed(d: _Decisions, e: ev.EvalEpisodeCompleted) -> None:
    """An eval result changes nothing the train rules read: refill the eval permits, report a
    finished eval, and stop if the drain waited only for it."""
    on_eval_result(d, e)
    finish_drain(d)


def on_finalize_failed(d: _Decisions, e: ev.FinalizeFailed) -> None:
    """Rule 10: recorded; the shell re-raises the original error in its main loop."""


def on_trainer_restarted(d: _Decisions, e: ev.TrainerRestarted) -> None:
    """Recorded only: the trainer resumes from its checkpoint and takes the same next step; the
    batches it has not trained are on disk, and the versions it publishes arrive as before."""


def on_endpoint_changed(d: _Decisions, e: ev.EndpointChanged) -> None:
    """Recorded only: the episodes a down server fails come back as failed completions, and a
    restarted one is brought to the current version before it serves again."""


_INPUT_RULES: dict[str, Callable] = {
    "run_started": on_run_started,
    "run_resumed": on_run_resumed,
    "episode_completed": on_episode_completed,
    "background_finalized": on_background_finalized,
    "finalize_failed": on_finalize_failed,
    "version_published": on_version_published,
    "stop_requested": on_stop_requested,
    "trainer_restarted": on_trainer_restarted,
    "endpoint_changed": on_endpoint_changed,
    "eval_episode_completed": on_eval_episode_completed,
}
assert set(_INPUT_RULES) == ev.INPUT_KINDS

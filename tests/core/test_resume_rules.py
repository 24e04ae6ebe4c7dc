"""Rule 10 (resume, docs/rules.md) in the pure core: fold the log, then `run_resumed`.

The queue is swept at every step advance, so on resume it is already fresh; what can age out
while a run is down are the finished members of open groups (never swept live), which is where
the resume-time staleness drop (docs/rules.md, 5. Staleness) bites here."""

from __future__ import annotations

from orchestrator.core import events as ev
from orchestrator.core.evolve import fold
from orchestrator.core.state import conservation, state_hash


def crash_and_resume(d, max_steps=None):
    """Rebuild the state from the log alone, as a restarted process would, then resume."""
    d.state = fold(d.log)
    return d.feed(ev.RunResumed(from_seq=len(d.log), max_steps=max_steps or d.params.max_steps))


def test_pending_queue_comes_back_exactly_then_the_stale_sweep_runs_and_a_full_batch_ships(driver):
    d = driver(group_size=2, batch_size=4, max_inflight=4, max_off_policy_steps=0, target_lag=3)
    d.start()
    d.complete_group(1, [0.0, 1.0])  # 2 queued traces from v0
    live_hash = state_hash(d.state)
    assert state_hash(fold(d.log)) == live_hash  # the queue is rebuilt exactly
    d.publish(1)
    # pretend the step advanced while we were down: ship batch 1 from other traces first
    d.complete_group(2, [0.0, 1.0])  # 4 queued -> batch 1 ships [1..4]; step 2; min fresh = 1
    d.complete(5, reward=0.0, policy_start=1)
    d.complete(6, reward=1.0, policy_start=1)  # group 3 queued (v1)
    out = crash_and_resume(d)
    kinds = [e.kind for e in out]
    assert "traces_dropped" not in kinds  # v1 traces are fresh at step 2
    assert list(d.state.pending) == [5, 6]


def test_open_group_keeps_fresh_members_redispatches_the_rest_and_scores_only_fresh(driver):
    d = driver(group_size=3, batch_size=3, max_inflight=3, max_off_policy_steps=0, target_lag=5)
    d.start()  # group 1: episodes 1, 2, 3 at v0
    d.complete(1, reward=1.0, policy_start=0)  # a member from v0
    d.publish(1)
    d.complete(2, reward=0.0, policy_start=1)  # a member from v1; refill: episodes 4, 5 (group 2)
    # step is 1, so min fresh is 0: nothing stale yet. Make the v0 member age out: ship batch 1.
    d.complete_group(2, [0.0, 1.0])  # group 2 has 2 members in flight + needs 1 more
    group2_left = [e for e, g in d.state.inflight.items() if g == 2]
    for e in group2_left:
        d.complete(e, reward=0.5)
    assert d.state.step == 2  # batch 1 shipped: min fresh version is now 1
    assert 1 in d.state.groups and list(d.state.groups[1].members) == [1, 2]
    out = crash_and_resume(d)
    dropped = [e for e in out if e.kind == "traces_dropped"]
    assert dropped[0].trace_ids == [1] and dropped[0].reason == "stale"  # the v0 member ages out
    cancelled = [e for e in out if e.kind == "episode_cancelled"]
    assert 3 in [c.episode_id for c in cancelled] and {c.reason for c in cancelled} == {"resume"}
    redispatched = [e for e in out if e.kind == "episode_dispatched" and e.group_id == 1]
    assert len(redispatched) == 2 and all(e.episode_id > 3 for e in redispatched)  # same group, new ids
    first_new_group = [e for e in out if e.kind == "group_dispatched"]
    if first_new_group:  # missing members are dispatched before any new task
        assert out.index(redispatched[-1]) < out.index(first_new_group[0])
    # complete the group: only fresh members (2 and the re-run ones) are scored
    for e in [x.episode_id for x in redispatched]:
        out = d.complete(e, reward=1.0, policy_start=1)
    started = [e for e in d.log if e.kind == "finalize_started" and e.group_id == 1][0]
    assert 1 not in started.episode_ids and 2 in started.episode_ids and len(started.episode_ids) == 3
    assert conservation(d.state)[0]


def test_finalizing_groups_are_finalized_again_and_inflight_episodes_rerun(driver):
    d = driver(group_size=2, batch_size=100, max_inflight=4, finalize_in_background=True)
    d.start()
    d.complete_group(1, [0.0, 1.0])  # finalizing in the background, result lost in the crash
    inflight_before = sorted(d.state.inflight)
    out = crash_and_resume(d)
    restarted = [e for e in out if e.kind == "finalize_started"]
    assert [(e.group_id, e.background, e.episode_ids) for e in restarted] == [(1, True, [1, 2])]
    assert d.state.finalizing == {"a": 1}  # counted once, not twice
    assert sorted(e.episode_id for e in out if e.kind == "episode_cancelled") == inflight_before
    assert d.state.acct.rerun_attempts == len(inflight_before)
    out = d.feed(ev.BackgroundFinalized(group_id=1, episode_ids=[1, 2], advantages=[-0.5, 0.5]))
    assert [e.kind for e in out][0] == "group_settled" and list(d.state.pending) == [1, 2]
    assert conservation(d.state)[0]


def test_a_resume_that_lowers_max_steps_stops_only_once_every_shipped_batch_is_trained(driver):
    """Drain at once (max_steps is behind), but rule 9's stop waits for the last batch shipped."""
    d = driver(group_size=2, batch_size=2, max_inflight=8, max_off_policy_steps=5, target_lag=3, max_steps=10)
    d.start()
    for group_id in (1, 2, 3):
        d.complete_group(group_id, [0.0, 1.0])
    assert (d.state.step, d.state.version) == (4, 0)  # batches 1-3 shipped, none trained yet
    out = crash_and_resume(d, max_steps=1)
    assert "drain_started" in d.kinds(out) and "run_stopped" not in d.kinds(out)
    assert "run_stopped" not in d.kinds(d.publish(1) + d.publish(2))
    assert d.of(d.publish(3), "run_stopped")[0].reason == "completed"


def test_damaged_traces_are_dropped_first_a_finalizing_group_cancelled_whole(driver):
    """`--drop-damaged` (docs/resume.md): held traces whose payloads are lost never train. A
    queued one is dropped; an open group's member too, its slot re-run; a finalizing group is
    cancelled, since its scores included the lost one."""
    d = driver(group_size=2, batch_size=100, max_inflight=6, finalize_in_background=True)
    d.start()  # groups 1, 2, 3: episodes 1..6
    d.complete_group(1, [0.0, 1.0])
    d.feed(ev.BackgroundFinalized(group_id=1, episode_ids=[1, 2], advantages=[-0.5, 0.5]))  # 1, 2 queued
    d.complete_group(2, [0.0, 1.0])  # 3, 4 finalizing
    d.complete(5, reward=1.0)  # an open group's member
    assert list(d.state.pending) == [1, 2] and d.state.groups[2].finalizing and 5 in d.state.groups[3].members
    d.state = fold(d.log)
    out = d.feed(ev.RunResumed(from_seq=len(d.log), max_steps=d.params.max_steps, damaged_traces=[1, 3, 5]))
    damaged = [e for e in out if getattr(e, "reason", None) == "damaged"]
    assert [(e.kind, getattr(e, "group_id", None), getattr(e, "trace_ids", None)) for e in damaged] == [
        ("group_cancelled", 2, None),
        ("traces_dropped", None, [1, 5]),
    ]
    assert not any(e.kind == "finalize_started" and e.group_id == 2 for e in out)  # not re-finalized
    assert list(d.state.pending) == [2] and not {1, 3, 4, 5} & set(d.state.traces)
    assert any(e.kind == "episode_dispatched" and e.group_id == 3 for e in out)  # 5's slot re-run
    assert d.state.acct.dropped["damaged"] == 4 and conservation(d.state)[0]
    assert state_hash(fold(d.log)) == state_hash(d.state)

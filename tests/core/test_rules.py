"""One focused test per rule of docs/rules.md (inline path unless stated)."""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator.core import events as ev
from orchestrator.core.decide import decide
from orchestrator.core.state import conservation, state_hash

# --- rule 1: dispatch ----------------------------------------------------------------------------


def test_dispatch_fills_permits_and_fills_a_group_before_starting_the_next(driver):
    d = driver(group_size=3, max_inflight=7, batch_size=100)
    out = d.start()
    dispatched = d.of(out, "episode_dispatched")
    assert len(dispatched) == 7
    assert [e.group_id for e in dispatched] == [1, 1, 1, 2, 2, 2, 3]
    assert [e.attempt for e in dispatched] == [0, 1, 2, 0, 1, 2, 0]
    # a freed permit goes to the unfilled group 3 first
    out = d.complete(1)
    assert [(e.group_id, e.episode_id) for e in d.of(out, "episode_dispatched")] == [(3, 8)]


def test_env_choice_follows_ratios_with_the_seeded_rng_and_cursors_advance(driver):
    d = driver(env_ratios={"a": 1.0, "b": 3.0}, group_size=1, max_inflight=4000, batch_size=10**6, seed=5)
    out = d.start()
    groups = d.of(out, "group_dispatched")
    share_b = Counter(g.env for g in groups)["b"] / len(groups)
    assert 0.72 < share_b < 0.78
    for env in ("a", "b"):
        task_ids = [g.task_id for g in groups if g.env == env]
        assert task_ids == list(range(len(task_ids)))  # each env's sampler cursor advances by one
    again = driver(env_ratios={"a": 1.0, "b": 3.0}, group_size=1, max_inflight=4000, batch_size=10**6, seed=5)
    assert [g.env for g in again.of(again.start(), "group_dispatched")] == [g.env for g in groups]


def test_gate_closes_on_off_policy_lag_and_reopens_on_publish(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=2, target_lag=0, max_off_policy_steps=5)
    d.start()
    out = d.complete_group(1, [0.0, 1.0])  # ships batch 1 -> step 2, version 0: lag 1 > 0
    assert d.of(out, "batch_shipped")[0].step == 1
    gate = d.of(out, "gate_changed")
    assert gate and gate[-1].open is False and gate[-1].reason == "off_policy_lag"
    # the completions refilled their permits before the cut; once closed, nothing is refilled
    out = d.complete(3)
    assert not d.of(out, "episode_dispatched") and len(d.state.inflight) == 1
    out = d.publish(1)
    assert d.of(out, "gate_changed")[-1].open is True
    assert len(d.of(out, "episode_dispatched")) == 1


def test_gate_closes_at_the_finalizing_cap_and_reopens_below_it(driver):
    d = driver(group_size=1, batch_size=100, max_inflight=3, finalize_in_background=True, max_finalizing_groups=2)
    d.start()
    d.complete(1)
    out = d.complete(2)
    assert d.of(out, "gate_changed")[-1].reason == "finalizing_cap"
    inflight_before = len(d.state.inflight)
    out = d.complete(3)  # in-flight episodes keep flowing; nothing new is dispatched
    assert not d.of(out, "episode_dispatched") and len(d.state.inflight) == inflight_before - 1
    out = d.feed(ev.BackgroundFinalized(group_id=1, episode_ids=[1], advantages=[0.5]))
    assert d.state.finalizing == {"a": 2}  # groups 2, 3 still finalizing: still at cap
    assert not d.of(out, "episode_dispatched")
    out = d.feed(ev.BackgroundFinalized(group_id=2, episode_ids=[2], advantages=[0.5]))
    assert d.of(out, "gate_changed")[-1].open is True
    assert d.of(out, "episode_dispatched")


# --- rules 2-4: completion, finalize, settle ------------------------------------------------------


def test_errored_episode_counts_as_failure_and_completes_the_group(driver):
    d = driver(group_size=2, batch_size=100, max_inflight=2)
    d.start()
    d.complete(1, ok=False)
    out = d.complete(2, reward=1.0)
    settled = d.of(out, "group_settled")[0]
    assert d.state.acct.failures == 1
    assert settled.dropped["failed"] == [1]
    assert settled.admitted is False  # one survivor: advantage 0 -> rejected
    assert settled.dropped["rejected"] == [2]


def test_grpo_advantage_is_reward_minus_group_mean(driver):
    d = driver(group_size=4, batch_size=100, max_inflight=4)
    d.start()
    out = d.complete_group(1, [0.0, 0.25, 0.5, 1.0])
    finalized = d.of(out, "group_finalized")[0]
    assert finalized.advantages == pytest.approx([-0.4375, -0.1875, 0.0625, 0.5625])
    assert d.of(out, "finalize_started")[0].background is False


def test_group_without_survivors_is_accounted_only(driver):
    d = driver(group_size=2, batch_size=4, max_inflight=2)
    d.start()
    out = d.complete(1, sampled=0) + d.complete(2, ok=False)
    assert "finalize_started" not in d.kinds(out)
    settled = d.of(out, "group_settled")[0]
    assert settled.admitted is False and settled.dropped == {"no_output": [1], "failed": [2]}
    assert d.state.acct.groups_without_output == 1 and d.state.acct.zero_output_run == 2


def test_ten_batch_equivalents_of_zero_output_stop_the_run_with_an_error(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=2, zero_output_batches=10)
    d.start()
    for _ in range(9):
        group = next(iter(d.state.groups))
        d.complete_group(group, [0.5, 0.5], sampled=0)
        assert not d.state.stopped
    group = next(iter(d.state.groups))
    out = d.complete_group(group, [0.5, 0.5], sampled=0)
    stopped = d.of(out, "run_stopped")[0]
    assert stopped.reason == "zero_output" and stopped.error is True


def test_admission_rejects_all_zero_advantage_groups(driver):
    d = driver(group_size=3, batch_size=100, max_inflight=3)
    d.start()
    out = d.complete_group(1, [0.5, 0.5, 0.5])
    settled = d.of(out, "group_settled")[0]
    assert settled.admitted is False and not settled.sample_ids and d.state.acct.groups_rejected == 1


def test_constant_batch_size_prunes_zero_advantage_samples_at_insertion(driver):
    d = driver(group_size=3, batch_size=100, max_inflight=3, constant_trainer_batch_size=True)
    d.start()
    out = d.complete_group(1, [0.0, 0.5, 1.0])  # advantages -0.5, 0, 0.5
    settled = d.of(out, "group_settled")[0]
    assert settled.sample_ids == [1, 3] and settled.dropped == {"zero_advantage": [2]}


def test_insertion_sweep_drops_traces_already_stale(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=4, max_off_policy_steps=0, target_lag=5)
    d.start()
    d.complete_group(1, [0.0, 1.0])  # batch 1 ships: step 2, min fresh version = 1
    out = d.complete(3, reward=0.0, policy_start=0)
    out += d.complete(4, reward=1.0, policy_start=0)
    settled = d.of(out, "group_settled")[0]
    # members older than min_fresh_version are left out of scoring, then dropped as stale
    assert "finalize_started" not in d.kinds(out)
    assert settled.dropped == {"stale": [3, 4]}


# --- rule 5: staleness ----------------------------------------------------------------------------


def test_full_sweep_once_per_step_drops_queued_traces_that_aged_out(driver):
    d = driver(group_size=2, batch_size=4, max_inflight=4, max_off_policy_steps=0, target_lag=5)
    d.start()
    d.complete_group(1, [0.0, 1.0])  # 2 queued from v0
    out = d.complete_group(2, [0.0, 1.0])  # 4 queued -> batch 1 ships them
    assert d.of(out, "batch_shipped")[0].sample_ids == [1, 2, 3, 4]
    d.complete(5, reward=0.0)  # dispatched at v0, group 3 stays open
    d.complete(6, reward=1.0)  # group 3 complete: scored at step 2 -> members stale (v0 < 1)
    assert d.state.acct.dropped["stale"] == 2


def test_step_advance_cancels_finalizing_groups_that_would_be_stale_on_insertion(driver):
    d = driver(
        group_size=2, batch_size=2, max_inflight=6, max_off_policy_steps=0, target_lag=5, finalize_in_background=True
    )
    d.start()
    d.complete_group(1, [0.0, 1.0])  # group 1 finalizing (v0 traces)
    d.publish(1)
    d.complete(3, reward=0.0, policy_start=1)
    d.complete(4, reward=1.0, policy_start=1)  # group 2 finalizing (v1 traces)
    d.complete(5, reward=0.0, policy_start=1)
    d.complete(6, reward=1.0, policy_start=1)  # group 3 finalizing (v1 traces)
    out = d.feed(ev.BackgroundFinalized(group_id=3, episode_ids=[5, 6], advantages=[-0.5, 0.5]))
    # batch 1 ships -> step 2 -> min fresh 1: group 1 (v0) is cancelled, group 2 (v1) is not
    assert d.of(out, "batch_shipped")
    cancelled = d.of(out, "group_cancelled")
    assert [(c.group_id, c.reason, c.count) for c in cancelled] == [(1, "stale", 2)]
    assert 2 in d.state.groups and d.state.groups[2].finalizing
    # a late result for the cancelled group is ignored
    late = d.feed(ev.BackgroundFinalized(group_id=1, episode_ids=[1, 2], advantages=[-0.5, 0.5]))
    assert late == [] and d.state.acct.late == 1


# --- rules 6-8: batch cut, ship hold, version publish -----------------------------------------


def test_batch_cut_is_oldest_first_stable_and_keeps_groups_together(driver):
    d = driver(group_size=2, batch_size=3, max_inflight=4, target_lag=10, max_off_policy_steps=10)
    d.start()  # groups 1 (episodes 1, 2) and 2 (3, 4) dispatched at v0
    d.publish(1)
    d.complete(3, reward=0.0)  # refills episode 5: group 3, dispatched at v1
    d.complete(5, reward=0.0)  # refills episode 6 (group 3)
    d.complete(6, reward=1.0)  # group 3 settles first: queue [5, 6] (v1)
    out = d.complete(4, reward=1.0)  # group 2 settles: queue [5, 6, 3, 4]; the cut sorts v0 first
    shipped = d.of(out, "batch_shipped")[0]
    assert shipped.sample_ids == [3, 4, 5]
    assert list(d.state.pending) == [6]  # the youngest trace overflows


def test_token_batching_cuts_by_tokens(driver):
    d = driver(group_size=2, batch_size=1000, token_batch_size=10, max_inflight=4)
    d.start()
    out = d.complete_group(1, [0.0, 1.0], sampled=3, prompt=1)  # 8 tokens: not enough
    assert not d.of(out, "batch_shipped")
    out = d.complete_group(2, [0.0, 1.0], sampled=3, prompt=1)  # 16 tokens: cut <= 10 tokens
    shipped = d.of(out, "batch_shipped")[0]
    assert shipped.sample_ids == [1, 2] and shipped.n_tokens == 8


def test_without_constant_batch_size_zero_advantage_samples_are_pruned_at_the_cut(driver):
    d = driver(group_size=3, batch_size=3, max_inflight=3)
    d.start()
    out = d.complete_group(1, [0.0, 0.5, 1.0])
    shipped = d.of(out, "batch_shipped")[0]
    assert shipped.sample_ids == [1, 3] and shipped.pruned_ids == [2]


def test_ship_hold_waits_for_the_trainer_and_stamps_true_lag(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=8, target_lag=1, max_off_policy_steps=5)
    d.start()
    for group in (1, 2, 3):
        d.complete_group(group, [0.0, 1.0])
    shipped = [e.step for e in d.log if e.kind == "batch_shipped"]
    assert shipped == [1, 2]  # batch 3 needs version >= 1
    out = d.publish(1)
    batch3 = d.of(out, "batch_shipped")[0]
    assert batch3.step == 3
    assert batch3.off_policy_max == 2 and batch3.off_policy_mean == 2.0  # (3-1) - v0, queue time included


# --- rule 9: drain and stop -------------------------------------------------------------------


def test_drain_at_max_steps_cancels_work_and_stops_after_the_last_publish(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=6, max_steps=1, target_lag=3)
    d.start()
    d.complete(3)  # group 2 open with one member
    out = d.complete_group(1, [0.0, 1.0])
    assert d.kinds(out).count("drain_started") == 1
    assert {e.reason for e in d.of(out, "episode_cancelled")} == {"drain"}
    cancelled = d.of(out, "group_cancelled")
    assert 2 in [c.group_id for c in cancelled] and {c.reason for c in cancelled} == {"drain"}
    assert not d.state.inflight and not d.state.groups and not d.state.pending
    assert not d.state.stopped  # waits for the trainer
    out = d.publish(1)
    assert d.of(out, "run_stopped")[0].reason == "completed"
    assert conservation(d.state)[0]


def test_stop_request_cancels_everything_and_stops(driver):
    d = driver(group_size=2, batch_size=100, max_inflight=4)
    d.start()
    d.complete(1)
    out = d.feed(ev.StopRequested(reason="interrupted"))
    assert d.of(out, "run_stopped")[0].reason == "interrupted"
    acct = d.state.acct
    assert acct.cancelled_attempts == acct.dispatched - 1 and acct.dropped == {"stop": 1}
    assert not d.state.inflight and not d.state.groups
    assert d.feed(ev.StopRequested(reason="again")) == []


# --- errors: a finalize failure (rule 3), a late or misdirected completion (rule 2) ---------------


def test_finalize_failure_is_recorded_and_nothing_is_decided(driver):
    d = driver(group_size=1, batch_size=100, max_inflight=1, finalize_in_background=True)
    d.start()
    d.complete(1)
    out = d.feed(ev.FinalizeFailed(group_id=1, error="GraderError: down"))
    assert out == [] and d.state.finalize_errors == {1: "GraderError: down"}


def test_late_completion_of_a_cancelled_episode_is_ignored(driver):
    d = driver(group_size=2, batch_size=100, max_inflight=2)
    d.start()
    d.feed(ev.StopRequested(reason="x"))
    before = d.state.acct.completed
    d.feed(
        ev.EpisodeCompleted(
            episode_id=1, group_id=1, ok=True, reward=0.0, temperature=1.0, policy_start=0, policy_end=0
        )
    )
    assert d.state.acct.completed == before and d.state.acct.late == 1


def test_a_completion_for_another_group_than_its_dispatch_is_refused_before_any_change(driver):
    d = driver(group_size=2, batch_size=100, max_inflight=4)
    d.start()
    assert d.state.inflight[1] == 1 and d.state.inflight[3] == 2
    before = state_hash(d.state)
    with pytest.raises(ValueError, match="episode 1 completed for group 2, but it was dispatched into group 1"):
        d.feed(
            ev.EpisodeCompleted(
                episode_id=1, group_id=2, ok=True, reward=0.0, temperature=1.0, policy_start=0, policy_end=0
            )
        )
    assert state_hash(d.state) == before


def test_decisions_are_not_inputs(driver):
    d = driver()
    d.start()
    with pytest.raises(ValueError, match="not an input"):
        d.feed(ev.DrainStarted(reason="x"))


def test_a_scored_group_is_a_decision_inline_and_an_input_only_from_the_background(driver):
    """The role is the kind's: `decide` refuses the inline kind as an input."""
    assert (ev.GroupFinalized.role, ev.BackgroundFinalized.role) == ("decision", "input")
    d = driver(group_size=1, batch_size=100, max_inflight=1, finalize_in_background=True)
    d.start()
    d.complete(1)
    with pytest.raises(ValueError, match="'group_finalized' is a decision, not an input"):
        decide(d.state, ev.GroupFinalized(group_id=1, episode_ids=[1], advantages=[0.5]))
    settled = d.of(d.feed(ev.BackgroundFinalized(group_id=1, episode_ids=[1], advantages=[0.5])), "group_settled")
    assert settled and settled[0].sample_ids == [1]

"""Rule 1 (d), the dispatch capacity (`rollout.capacity = "staleness"`): a new group starts only
while the work dispatched and not yet shipped or dropped can still train before it is too old."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator.config import load_config, meaning_changes
from orchestrator.core import events as ev
from orchestrator.core.decide import capacity_has_room, dispatch_gate, trainer_keeps_up
from tests.core.encoded import fold_encoded
from tests.support.params import trainer_bound_params
from tests.support.sim import SimOptions, TimedSimWorld

VARIED = [0.0, 0.25, 0.5, 1.0]  # rewards with spread: admitted, no zero advantage


def test_new_groups_start_until_the_steps_that_accept_them_are_full(driver):
    # max_off_policy_steps 1 at lag 0: steps 1 and 2 accept what is dispatched now, 2 x 8 samples.
    d = driver(group_size=4, batch_size=8, max_inflight=100, max_off_policy_steps=1, target_lag=0, capacity="staleness")
    out = d.start()
    assert len(d.of(out, "group_dispatched")) == 4 and len(d.state.inflight) == 16
    assert (d.state.gate_open, d.state.gate_reason) == (False, "capacity")
    off = driver(group_size=4, batch_size=8, max_inflight=100, max_off_policy_steps=1, target_lag=0)
    off.start()
    assert len(off.state.inflight) == 100, "capacity off: max_inflight alone"


def test_a_published_version_opens_the_capacity_of_one_more_step(driver):
    d = driver(group_size=4, batch_size=8, max_inflight=100, max_off_policy_steps=1, target_lag=1, capacity="staleness")
    d.start()
    d.complete_group(1, VARIED)
    out = d.complete_group(2, VARIED)
    assert d.of(out, "batch_shipped") and d.state.step == 2
    # Lag 1: only step 2 still accepts a sample dispatched at version 0, and groups 3 and 4 fill it.
    assert not d.of(out, "group_dispatched") and d.state.gate_reason == "capacity"
    d.complete_group(3, VARIED)
    out = d.complete_group(4, VARIED)
    assert d.of(out, "batch_shipped") and d.state.step == 3 and not d.state.inflight
    out = d.publish(1)  # batch 2 still in training: the trainer does not keep up
    assert len(d.of(out, "group_dispatched")) == 2, "step 3 accepts version 1: room for 8 more"
    assert d.state.gate_reason == "capacity"


def test_a_trainer_that_keeps_up_gets_every_permit(driver):
    """Generation-bound: once the trainer trained every batch shipped and nothing waits in the
    queue, the capacity does not throttle; max_inflight alone caps dispatch."""
    d = driver(group_size=4, batch_size=8, max_inflight=40, max_off_policy_steps=1, target_lag=1, capacity="staleness")
    d.start()
    assert len(d.state.inflight) == 16, "the run's start: the capacity applies"
    d.complete_group(1, VARIED)
    d.complete_group(2, VARIED)  # batch 1 ships
    out = d.publish(1)  # trained: the trainer waits for batch 2
    assert d.of(out, "group_dispatched") and len(d.state.inflight) == 40
    assert d.state.gate_open


def test_rejected_groups_make_it_over_provision(driver):
    d = driver(group_size=4, batch_size=8, max_inflight=100, max_off_policy_steps=1, target_lag=0, capacity="staleness")
    d.start()
    out = d.complete_group(1, [0.5] * 4)  # all-zero advantages: rejected
    assert d.of(out, "group_settled")[0].admitted is False
    # Admission so far (prior: one batch fully admitted): 8 queued per 12 judged. The 3 open
    # groups' 12 samples are expected to bring 8; there is room until 24 are expected to bring 16.
    assert len(d.of(out, "group_dispatched")) == 3
    assert d.state.grouped_episodes == 24 and d.state.gate_reason == "capacity"


def test_a_started_group_is_dispatched_in_full_while_the_capacity_holds_new_ones_back(driver):
    d = driver(group_size=4, batch_size=4, max_inflight=3, max_off_policy_steps=0, target_lag=0, capacity="staleness")
    d.start()
    assert len(d.state.inflight) == 3 and d.state.gate_reason == "capacity"
    out = d.complete(1)
    assert [(e.group_id, e.attempt) for e in d.of(out, "episode_dispatched")] == [(1, 3)]
    assert not d.of(out, "group_dispatched")


def test_tokens_per_sample_set_the_capacity_with_token_batching(driver):
    # Prior: 30 tokens fill one batch of 8 samples. One step accepts (max_off_policy_steps 0).
    d = driver(
        group_size=2,
        batch_size=8,
        token_batch_size=30,
        max_inflight=100,
        max_off_policy_steps=0,
        target_lag=0,
        capacity="staleness",
    )
    d.start()
    assert d.state.grouped_episodes == 8, "8 samples expected to bring 30 tokens"
    # Samples of 3 tokens. Once one group settled, a sample is expected to bring (30 + 6) /
    # (8 + 2) = 3.6 tokens: the 6 queued and 6 grouped samples (27.6) leave no room for one more.
    out = d.complete_group(1, [0.0, 1.0], sampled=2)
    assert not d.of(out, "group_dispatched") and d.state.grouped_episodes == 6
    # Once two settled, (30 + 12) / (8 + 4) = 3.5 tokens: 12 queued and 4 grouped (26) do.
    out = d.complete_group(2, [0.0, 1.0], sampled=2)
    assert d.state.pending_tokens == 12 and not d.of(out, "batch_shipped")
    assert len(d.of(out, "group_dispatched")) == 1 and d.state.grouped_episodes == 6
    assert d.state.gate_reason == "capacity"


def test_no_room_when_no_step_could_train_a_sample_dispatched_now(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=10, max_off_policy_steps=0, target_lag=2, capacity="staleness")
    d.start()
    assert len(d.state.inflight) == 2, "one step accepts: one group"
    d.complete_group(1, [0.0, 1.0])  # batch 1 ships: step 2 at version 0, where version 0 is stale
    s = d.state
    assert s.step == 2 and s.version == 0 and not s.inflight and not capacity_has_room(s)
    assert dispatch_gate(s) == (False, "capacity")
    out = d.publish(1)  # the batch in training publishes: the trainer keeps up, every permit is used
    assert len(d.of(out, "group_dispatched")) == 5 and len(d.state.inflight) == 10


def test_the_capacity_travels_in_run_started():
    off, on = ev.RunStarted(params=ev.CoreParams()), ev.RunStarted(params=ev.CoreParams(capacity="staleness"))
    assert orjson.loads(ev.encode_event(off)[1])["params"]["capacity"] == "off"
    assert orjson.loads(ev.encode_event(on)[1])["params"]["capacity"] == "staleness"
    state, _ = fold_encoded(None, [off])
    assert state.params.capacity == "off"
    state, _ = fold_encoded(None, [on])
    assert state.params.capacity == "staleness"


def test_the_config_turns_it_on_and_a_resume_may_not_turn_it_off_or_on(tmp_path):
    config = load_config(None, [])
    assert config.rollout.capacity == "staleness" and config.core_params().capacity == "staleness"
    old = load_config(None, ["rollout.capacity=off"])
    assert old.rollout.capacity == "off" and old.core_params().capacity == "off"
    # Turning it on in a resume of such a run changes what the run computes: refused.
    resumed = load_config(None, ["rollout.capacity=staleness"], base=old.model_dump(mode="json"))
    assert meaning_changes(old, resumed) == ["rollout.capacity"]


# --- the property: a steady trainer-bound run wastes next to nothing to staleness ----------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    group_size=st.sampled_from([4, 8]),
    groups_per_batch=st.integers(8, 16),
    target_lag=st.integers(0, 1),
    max_off_beyond_lag=st.integers(1, 2),
    slack=st.integers(4, 8),
    latency=st.sampled_from([(1, 9), (3, 7), (4, 6), (1, 5)]),
    train_ticks=st.integers(5, 8),
    error_rate=st.floats(0.0, 0.02),
)
def test_stale_fraction_stays_small_in_a_steady_trainer_bound_run(
    seed, group_size, groups_per_batch, target_lag, max_off_beyond_lag, slack, latency, train_ticks, error_rate
):
    """Trainer-bound: a step takes the trainer at least half as long as the slowest episode
    takes, and the sampler could keep `slack` batches in flight (off, most of it goes stale).
    Steady: the samples may be one step older than the lag the gate allows, so a group's
    stragglers have a step to catch up in, and a group is at most an eighth of a batch (the
    capacity overshoots by less than a group)."""
    batch_size = group_size * groups_per_batch
    max_off = target_lag + max_off_beyond_lag
    params = trainer_bound_params(
        seed,
        group_size=group_size,
        batch_size=batch_size,
        max_inflight=slack * batch_size,
        max_off_policy_steps=max_off,
        target_lag=target_lag,
        capacity="staleness",
    )
    options = SimOptions(error_rate=error_rate, empty_rate=0.0, reward_levels=20)
    world = TimedSimWorld(params, seed=seed, options=options, latency=latency, train_ticks=train_ticks)
    world.run()
    acct = world.state.acct
    assert world.state.stop_reason == "completed"
    assert acct.dropped.get("stale", 0) <= 0.05 * acct.completed, acct


@pytest.mark.parametrize("seed", range(3))
def test_off_the_same_run_drops_most_of_what_it_generates(seed):
    """The property above is not vacuous: the same world without the rule burns its slack."""
    params = trainer_bound_params(seed)
    options = SimOptions(error_rate=0.0, empty_rate=0.0, reward_levels=20)
    world = TimedSimWorld(params, seed=seed, options=options, latency=(1, 9), train_ticks=5)
    world.run()
    acct = world.state.acct
    assert acct.dropped["stale"] > 0.5 * acct.completed


# --- the property, generation-bound: a trainer that keeps up is never throttled ------------------


class CheckedWorld(TimedSimWorld):
    """After every input: while the trainer keeps up and no other reason closes the gate, every
    train permit is in use (the capacity admits what max_inflight allows)."""

    kept_up = 0  # inputs after which the trainer kept up
    throttled = 0  # those after which a permit was unused

    def feed(self, event) -> list:
        decisions = super().feed(event)
        s = self.state
        if trainer_keeps_up(s) and dispatch_gate(s)[1] in ("open", "capacity") and s.step <= s.params.max_steps:
            self.kept_up += 1
            self.throttled += len(s.inflight) < s.params.max_inflight
        return decisions


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(seed=7, group_size=4, groups_per_batch=7, max_off_policy_steps=2, slack=7, latency=(1, 9))
@given(
    seed=st.integers(0, 10**6),
    group_size=st.sampled_from([4, 8]),
    groups_per_batch=st.integers(4, 8),
    max_off_policy_steps=st.integers(1, 2),
    slack=st.integers(4, 8),
    latency=st.sampled_from([(1, 9), (3, 7), (1, 5)]),
)
def test_a_generation_bound_run_ships_as_fast_as_without_the_capacity(
    seed, group_size, groups_per_batch, max_off_policy_steps, slack, latency
):
    """Generation-bound: an instant trainer (it publishes at the tick its batch ships). The
    capacity never leaves a permit unused while the trainer keeps up, and the run takes no
    more ticks than the same world with the capacity off, within 3% and 2 ticks (a world of a
    small seed ships its last batch 2 ticks later with the capacity: seed 7, 59 against 57)."""
    ticks = {}
    for capacity in ("staleness", "off"):
        params = ev.CoreParams(
            seed=seed,
            env_ratios={"a": 1.0},
            group_size=group_size,
            batch_size=group_size * groups_per_batch,
            max_inflight=slack * group_size * groups_per_batch,
            max_off_policy_steps=max_off_policy_steps,
            target_lag=1,
            max_steps=20,
            zero_output_batches=1000,
            capacity=capacity,
        )
        options = SimOptions(error_rate=0.0, empty_rate=0.0, reward_levels=20)
        world = CheckedWorld(params, seed=seed, options=options, latency=latency, train_ticks=0)
        world.run()
        assert world.state.stop_reason == "completed"
        assert world.throttled == 0 and (world.kept_up > 0 or capacity == "off")
        ticks[capacity] = world.tick
    assert ticks["staleness"] <= ticks["off"] * 1.03 + 2, ticks

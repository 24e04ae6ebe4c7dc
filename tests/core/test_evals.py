"""Evaluations in the pure core (docs/evals.md): schedule, the train gate, pinning, figures,
drain, stop and resume, determinism, and held-out tasks kept out of training."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from orchestrator.core import events as ev
from orchestrator.core.evals import held_out_task_ids
from orchestrator.core.evolve import fold
from orchestrator.core.state import (
    conservation,
    state_bytes,
    state_from_bytes,
    state_hash,
)
from tests.core.encoded import fold_encoded
from tests.support.params import Driver, eval_params, eval_sim_params
from tests.support.sim import SimOptions, SimWorld


def of(log, kind: str) -> list:
    return [e for e in log if e.kind == kind]


def complete_eval_episode(
    d: Driver, episode_id: int, *, reward: float = 1.0, ok: bool = True, version: int | None = None, tokens: int = 3
) -> list:
    x = d.state.evals.open[d.state.evals.inflight[episode_id]]
    pinned = x.version if version is None else version
    return d.feed(
        ev.EvalEpisodeCompleted(
            episode_id=episode_id,
            eval_id=x.eval_id,
            ok=ok,
            reward=reward if ok else 0.0,
            success=(reward == 1.0) if ok else None,
            sampled_tokens=tokens if ok else 0,
            policy_start=pinned,
            policy_end=pinned,
            error=None if ok else "boom",
        )
    )


def test_evals_run_at_version_0_every_n_versions_and_at_the_end():
    world = SimWorld(eval_sim_params(max_steps=7, eval=eval_params(every=3)), seed=1)
    world.run()
    s = world.state
    assert s.stop_reason == "completed"
    assert [e.version for e in of(world.log, "eval_started")] == [0, 3, 6, 7]
    completed = of(world.log, "eval_completed")
    assert [e.version for e in completed] == [0, 3, 6, 7]
    assert all(e.scored + e.failures + e.off_version == 3 * 2 for e in completed)
    # The run stops only once the end's eval reported.
    kinds = [e.kind for e in world.log]
    assert kinds.index("run_stopped") > max(i for i, k in enumerate(kinds) if k == "eval_completed")
    assert conservation(s)[0]


def test_a_version_jump_starts_one_eval_at_the_version_reached():
    d = Driver(group_size=2, batch_size=2, max_inflight=2, max_steps=10, eval=eval_params(every=2))
    d.start()
    d.complete_group(min(d.state.groups), [0.0, 1.0])  # step 1 ships; the trainer publishes far ahead
    d.publish(5)
    assert [e.version for e in of(d.log, "eval_started")] == [0, 5]
    d.publish(5)
    assert len(of(d.log, "eval_started")) == 2  # nothing new is due at the same version


def test_the_finalizing_cap_closes_the_train_gate_while_evals_keep_flowing():
    """When the finalizing cap closes the train dispatch gate, train scheduling stops
    while evals and in-flight episodes keep flowing."""
    d = Driver(
        group_size=2,
        batch_size=4,
        max_inflight=4,
        max_steps=3,
        finalize_in_background=True,
        algorithm="gar",
        max_finalizing_groups=1,
        eval=eval_params(num_tasks=4, max_inflight=2),
    )
    d.start()
    assert len(d.state.evals.inflight) == 2 and len(d.state.inflight) == 4
    train_group = min(d.state.groups)
    out = d.complete_group(train_group, [0.0, 1.0])  # its grader result is held: finalizing
    assert d.state.gate_reason == "finalizing_cap" and not d.state.gate_open
    assert of(out, "gate_changed")[-1].open is False
    dispatched_before = d.state.acct.dispatched
    flowed = []
    for _ in range(6):  # eval results refill eval permits: nothing is waiting for the gate
        out = complete_eval_episode(d, next(iter(d.state.evals.inflight)))
        flowed += of(out, "eval_episode_dispatched")
        assert not of(out, "episode_dispatched")
    assert len(flowed) == 6 and d.state.acct.dispatched == dispatched_before
    # In-flight train episodes keep flowing too: they complete and their group finalizes.
    other = next(g for g in d.state.groups.values() if not g.finalizing)
    out = d.complete_group(other.group_id, [0.5, 0.25])
    assert not of(out, "episode_dispatched") and of(out, "finalize_started")


def test_eval_traffic_is_never_counted_in_the_train_accounting():
    with_evals = SimWorld(eval_sim_params(3), seed=3)
    with_evals.run()
    acct = with_evals.state.acct
    train_dispatches = of(with_evals.log, "episode_dispatched")
    assert acct.dispatched == len(train_dispatches)
    eval_acct = with_evals.state.evals.acct
    assert eval_acct.dispatched == len(of(with_evals.log, "eval_episode_dispatched")) > 0
    eval_episodes = {e.episode_id for e in of(with_evals.log, "eval_episode_dispatched")}
    shipped = {t for e in of(with_evals.log, "batch_shipped") for t in e.sample_ids}
    assert eval_episodes.isdisjoint(shipped) and eval_episodes.isdisjoint(e.episode_id for e in train_dispatches)
    assert conservation(with_evals.state)[0]


def test_a_sample_taken_by_another_version_is_counted_apart_from_the_figures():
    d = Driver(
        group_size=1,
        batch_size=1,
        max_inflight=1,
        max_steps=4,
        eval=eval_params(num_tasks=2, samples_per_task=2, max_inflight=4),
    )
    d.start()
    episodes = list(d.state.evals.inflight)
    complete_eval_episode(d, episodes[0], reward=1.0)
    complete_eval_episode(d, episodes[1], reward=0.0, version=1)  # another version sampled it
    complete_eval_episode(d, episodes[2], ok=False)
    out = complete_eval_episode(d, episodes[3], reward=0.5, tokens=5)
    (done,) = of(out, "eval_completed")
    assert (done.version, done.scored, done.off_version, done.failures) == (0, 2, 1, 1)
    assert done.reward_mean == pytest.approx(0.75) and done.tokens == 8
    # Task 0 (samples 0, 1): solved by sample 0; task 1 (samples 2, 3): failed, then 0.5.
    assert (done.pass_at_1, done.pass_at_k, done.k) == (0.5, 0.5, 2)
    assert conservation(d.state)[0]


def test_an_env_without_a_success_notion_reports_no_pass_at_k():
    d = Driver(
        group_size=1, batch_size=1, max_inflight=1, max_steps=4, eval=eval_params(num_tasks=1, samples_per_task=1)
    )
    d.start()
    (episode_id,) = d.state.evals.inflight
    out = d.feed(
        ev.EvalEpisodeCompleted(
            episode_id=episode_id,
            eval_id=1,
            ok=True,
            reward=0.3,
            success=None,
            sampled_tokens=2,
            policy_start=0,
            policy_end=0,
        )
    )
    (done,) = of(out, "eval_completed")
    assert done.reward_mean == 0.3 and done.pass_at_1 is None and done.pass_at_k is None


def test_a_result_naming_another_eval_is_refused_and_a_late_one_ignored():
    d = Driver(group_size=1, batch_size=1, max_inflight=1, max_steps=4, eval=eval_params(envs=["a"]))
    d.start()
    episode_id = next(iter(d.state.evals.inflight))
    with pytest.raises(ValueError, match="dispatched for eval 1"):
        d.feed(
            ev.EvalEpisodeCompleted(episode_id=episode_id, eval_id=7, ok=True, reward=0.0, policy_start=0, policy_end=0)
        )
    d.feed(ev.StopRequested(reason="test"))
    d.feed(ev.EvalEpisodeCompleted(episode_id=episode_id, eval_id=1, ok=True, reward=0.0, policy_start=0, policy_end=0))
    assert d.state.evals.acct.late == 1 and conservation(d.state)[0]


def test_the_drain_finishes_evals_in_flight_and_the_end_eval_before_stopping():
    d = Driver(
        group_size=2,
        batch_size=2,
        max_inflight=2,
        max_steps=2,
        target_lag=1,
        eval=eval_params(every=10, num_tasks=1, samples_per_task=2, max_inflight=1),
    )
    d.start()
    for _ in range(2):  # steps 1 and 2 ship: the drain starts, with version 0's eval still in flight
        d.complete_group(min(d.state.groups), [0.0, 1.0])
    assert d.state.draining and d.state.step == 3 and d.state.evals.open
    d.publish(1)
    d.publish(2)  # the trainer is done, but evals are still owed: version 0's and the end's
    assert not d.state.stopped
    assert [x.version for x in d.state.evals.open.values()] == [0, 2]
    while not d.state.stopped:
        complete_eval_episode(d, next(iter(d.state.evals.inflight)))
    assert d.state.stop_reason == "completed"
    assert [e.version for e in of(d.log, "eval_completed")] == [0, 2]


def test_a_stop_cancels_eval_episodes_and_a_resume_finishes_the_same_eval():
    d = Driver(
        group_size=1,
        batch_size=1,
        max_inflight=1,
        max_steps=3,
        eval=eval_params(num_tasks=2, samples_per_task=1, max_inflight=1),
    )
    d.start()
    first = next(iter(d.state.evals.inflight))
    complete_eval_episode(d, first, reward=1.0)
    out = d.feed(ev.StopRequested(reason="interrupted"))
    assert [e.reason for e in of(out, "eval_episode_cancelled")] == ["stop"]
    assert list(d.state.evals.open) == [1]  # stays open, its scored sample kept
    out = d.feed(ev.RunResumed(from_seq=len(d.log), max_steps=3))
    (again,) = of(out, "eval_episode_dispatched")
    assert (again.eval_id, again.sample, again.policy_version) == (1, 1, 0)
    out = complete_eval_episode(d, again.episode_id, reward=0.0)
    (done,) = of(out, "eval_completed")
    assert (done.scored, done.pass_at_1) == (2, 0.5)
    assert conservation(d.state)[0]


@pytest.mark.parametrize("through_snapshot", [False, True])
def test_a_crash_loses_in_flight_eval_episodes_and_resume_re_runs_them(through_snapshot):
    world = SimWorld(eval_sim_params(5), seed=5)
    world.start()
    while not (world.state.evals.inflight and world.state.evals.last_version > 0):  # mid-way through an eval
        assert world.advance()
    lost = {e: world.state.evals.open[x].inflight[e] for e, x in world.state.evals.inflight.items()}
    state, _ = fold_encoded(None, world.log)
    assert state is not None
    if through_snapshot:
        state = state_from_bytes(state_bytes(state))
    assert state_hash(state) == state_hash(world.state)
    world.state = state
    out = world.feed(ev.RunResumed(from_seq=len(world.log), max_steps=6))
    assert sorted(e.episode_id for e in of(out, "eval_episode_cancelled")) == sorted(lost)
    retaken = {e.sample for e in of(out, "eval_episode_dispatched")}
    assert set(lost.values()) <= retaken
    world.run()
    assert world.state.stop_reason == "completed" and not world.state.evals.open
    assert conservation(world.state)[0]


@pytest.mark.parametrize("seed", range(4))
def test_the_same_inputs_give_the_same_eval_events(seed):
    options = SimOptions(settle="random", eval_off_version_rate=0.1)
    runs = []
    for _ in range(2):
        world = SimWorld(eval_sim_params(seed, finalize_in_background=True), seed=seed, options=options)
        world.run()
        runs.append(world)
    a, b = ([ev.encode_event(e) for e in w.log] for w in runs)
    assert a == b and any(kind == "eval_completed" for kind, _, _ in a)
    assert state_hash(fold(runs[0].log)) == state_hash(runs[0].state)


def test_evals_off_decide_nothing_about_evals():
    world = SimWorld(eval_sim_params(2, eval=None), seed=2)
    world.run()
    assert not [e for e in world.log if e.kind.startswith("eval_")]
    assert world.log[0].params.eval is None
    assert "eval_dispatched" not in conservation(world.state)[1]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    group_size=st.integers(2, 4),
    every=st.integers(1, 4),
    num_tasks=st.integers(1, 6),
    max_steps=st.integers(2, 8),
    ratio=st.floats(0.2, 5.0),
    background=st.booleans(),
)
def test_eval_tasks_never_appear_in_train_groups(seed, group_size, every, num_tasks, max_steps, ratio, background):
    params = eval_sim_params(
        seed,
        group_size=group_size,
        max_steps=max_steps,
        env_ratios={"a": 1.0, "b": ratio},
        finalize_in_background=background,
        eval=eval_params(envs=["b", "a"], every=every, num_tasks=num_tasks),
    )
    world = SimWorld(params, seed=seed, options=SimOptions(settle="random"))
    world.run()
    held_out = set(held_out_task_ids(num_tasks))
    train_tasks = {(e.env, e.task_id) for e in of(world.log, "group_dispatched")}
    eval_tasks = {(x.env, t) for x in of(world.log, "eval_started") for t in x.task_ids}
    assert {t for _, t in eval_tasks} == held_out
    assert train_tasks.isdisjoint(eval_tasks)
    # Eval groups are their own: no train group shares an id with one.
    train_groups = {e.group_id for e in of(world.log, "group_dispatched")}
    eval_groups = {e.group_id for e in of(world.log, "eval_episode_dispatched")}
    assert train_groups.isdisjoint(eval_groups)
    assert world.state.stop_reason == "completed" and conservation(world.state)[0]

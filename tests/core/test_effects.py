"""The effect interpreter (orchestrator.effects): what a step's events call for, for every driver."""

from __future__ import annotations

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.state import Group
from orchestrator.effects import perform


class RecordingPort:
    """Every effect asked for, in order, as (name, what it names)."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def start_rollout(self, dispatched: ev.EpisodeDispatched, group: Group) -> None:
        self.calls.append(("start_rollout", (dispatched.episode_id, group.task_id)))

    def cancel_rollout(self, episode_id: int) -> None:
        self.calls.append(("cancel_rollout", episode_id))

    def start_eval_rollout(self, dispatched: ev.EvalEpisodeDispatched) -> None:
        self.calls.append(("start_eval_rollout", dispatched.episode_id))

    def cancel_eval_rollout(self, episode_id: int) -> None:
        self.calls.append(("cancel_eval_rollout", episode_id))

    def report_eval(self, completed: ev.EvalCompleted) -> None:
        self.calls.append(("report_eval", completed.eval_id))

    def start_finalize(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None:
        self.calls.append(("start_finalize", (started.group_id, [e.episode_id for e in episodes])))

    def cancel_finalize(self, group_id: int) -> None:
        self.calls.append(("cancel_finalize", group_id))

    def write_batch(self, shipped: ev.BatchShipped) -> None:
        self.calls.append(("write_batch", shipped.step))

    def notify_trainer(self, shipped: ev.BatchShipped) -> None:
        self.calls.append(("notify_trainer", shipped.step))

    def load_version(self, version: int) -> None:
        self.calls.append(("load_version", version))

    def drain(self) -> None:
        self.calls.append(("drain", None))

    def snapshot(self) -> None:
        self.calls.append(("snapshot", None))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def step(d, event) -> RecordingPort:
    port = RecordingPort()
    perform(d.state, [event, *d.feed(event)], port)
    return port


def test_dispatches_start_rollouts_of_their_groups_task(driver):
    d = driver(group_size=2, batch_size=4, max_inflight=3)
    port = step(d, ev.RunStarted(params=d.params))
    assert port.calls == [("start_rollout", (1, 0)), ("start_rollout", (2, 0)), ("start_rollout", (3, 1))]


def test_a_background_finalize_starts_with_the_survivors_and_is_cancelled_with_its_group(driver):
    d = driver(group_size=2, batch_size=100, max_inflight=2, finalize_in_background=True, max_steps=1)
    d.start()
    d.complete(1)
    completed = d.state.inflight.copy()
    port = RecordingPort()
    event = ev.EpisodeCompleted(
        episode_id=2,
        group_id=completed[2],
        ok=True,
        temperature=1.0,
        reward=1.0,
        tokens=Tokens.of([7, 7], [0, 1], [0.0, 0.0]),
        policy_start=0,
        policy_end=0,
    )
    perform(d.state, [event, *d.feed(event)], port)
    assert ("start_finalize", (1, [1, 2])) in port.calls
    port = step(d, ev.StopRequested(reason="test"))
    assert ("cancel_finalize", 1) in port.calls and port.names()[-1] == "snapshot"


def test_an_episode_dispatched_and_cancelled_in_the_same_step_is_not_started(driver):
    """A completion refills its permit, then its group ships the last batch and the drain cancels
    every in-flight episode, the one just dispatched too."""
    d = driver(group_size=2, batch_size=2, max_inflight=3, max_steps=1)
    d.start()
    d.complete(1, reward=1.0)
    event = ev.EpisodeCompleted(
        episode_id=2,
        group_id=1,
        ok=True,
        temperature=1.0,
        reward=0.0,
        tokens=Tokens.of([7, 7], [0, 1], [0.0, 0.0]),
        policy_start=0,
        policy_end=0,
    )
    decisions = d.feed(event)
    assert [e.episode_id for e in decisions if e.kind == "episode_dispatched"] == [5]
    port = RecordingPort()
    perform(d.state, [event, *decisions], port)
    assert "start_rollout" not in port.names()
    assert [arg for name, arg in port.calls if name == "cancel_rollout"] == [3, 4, 5]
    assert port.names().count("drain") == 1 and port.names().index("write_batch") < port.names().index("drain")


def test_a_finalize_restarted_and_cancelled_in_the_same_step_is_not_started(driver):
    """A resume re-finalizes its finalizing groups; when it lowers max_steps below the next step, it
    drains in the same step and cancels them: nothing is started, the cancel goes out."""
    d = driver(group_size=1, batch_size=1, max_inflight=2, finalize_in_background=True, max_steps=5)
    d.start()
    d.complete(1)
    d.feed(ev.BackgroundFinalized(group_id=1, episode_ids=[1], advantages=[0.5]))  # ships step 1
    d.complete(2)  # group 2 finalizing in the background
    resumed = ev.RunResumed(from_seq=len(d.log), max_steps=1)
    decisions = d.feed(resumed)
    assert [e.group_id for e in decisions if e.kind == "finalize_started"] == [2]
    port = RecordingPort()
    perform(d.state, [resumed, *decisions], port)
    assert "start_finalize" not in port.names() and "start_rollout" not in port.names()
    assert ("cancel_finalize", 2) in port.calls and "drain" in port.names()


def test_batches_are_all_written_before_the_trainer_hears_of_one_and_publishes_load(driver):
    d = driver(group_size=2, batch_size=2, max_inflight=4, target_lag=0, max_steps=3)
    d.start()
    d.complete_group(1, [0.0, 1.0])  # step 1 ships at once (version 0 >= 1-1-0)
    d.complete_group(2, [0.0, 1.0])  # step 2 is held until version 1
    port = step(d, ev.VersionPublished(version=1))
    assert port.calls[0] == ("load_version", 1)
    writes = [i for i, (name, _) in enumerate(port.calls) if name == "write_batch"]
    notes = [i for i, (name, _) in enumerate(port.calls) if name == "notify_trainer"]
    assert writes and len(writes) == len(notes) and max(writes) < min(notes)


def test_eval_episodes_start_a_finished_eval_is_reported_and_a_stop_cancels_the_rest(driver):
    eval_params = ev.EvalParams(envs=["a"], every=1, num_tasks=1, samples_per_task=2, max_inflight=2)

    def started_eval():
        d = driver(group_size=2, batch_size=100, max_inflight=2, eval=eval_params)
        port = step(d, ev.RunStarted(params=d.params))  # version 0 is evaluated at once
        started = [arg for name, arg in port.calls if name == "start_eval_rollout"]
        assert len(started) == 2 and set(started) == set(d.state.evals.inflight)
        return d, started

    def completed(d, episode_id):
        eval_id = d.state.evals.inflight[episode_id]
        return ev.EvalEpisodeCompleted(
            episode_id=episode_id,
            eval_id=eval_id,
            ok=True,
            reward=1.0,
            success=True,
            sampled_tokens=2,
            policy_start=0,
            policy_end=0,
        )

    d, (first, second) = started_eval()
    eval_id = d.state.evals.inflight[first]
    assert step(d, completed(d, first)).calls == []  # one sample of two: nothing to report yet
    assert step(d, completed(d, second)).calls == [("report_eval", eval_id)]
    d, (first, second) = started_eval()
    port = step(d, ev.StopRequested(reason="test"))
    assert [arg for name, arg in port.calls if name == "cancel_eval_rollout"] == [first, second]

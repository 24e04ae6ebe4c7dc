"""A verifiers episode as orch's samples (docs/verifiers.md, "What an episode is"), on verifiers'
own Trace and Episode objects: every trainable branch of every trainable trace a sample, each
sampled span's version that of the call that answered it, agents scored by their own rewards."""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers.v1")

import verifiers.v1 as vf  # noqa: E402
from verifiers.v1.configs.agent import AgentConfig  # noqa: E402
from verifiers.v1.episode import Episode  # noqa: E402
from verifiers.v1.graph import MessageNode  # noqa: E402
from verifiers.v1.trace import AgentInfo, Trace, TraceTask  # noqa: E402
from verifiers.v1.types import AssistantMessage, UserMessage  # noqa: E402

from orchestrator.contracts import RolloutRequest  # noqa: E402
from orchestrator.core import events as ev  # noqa: E402
from orchestrator.core.samples import split_episode  # noqa: E402
from orchestrator.verifiers.adapter import CallRecord, Rollout, prompt_key  # noqa: E402
from orchestrator.verifiers.env import Tally, VerifiersEpisodeError, completion  # noqa: E402

REQ = RolloutRequest(episode_id=5, group_id=2, env="verifiers", task_id=0, attempt=0, policy_version=3)


def prompt(parent, ids):
    return MessageNode(parent=parent, message=UserMessage(content="x"), token_ids=ids, mask=[False] * len(ids))


def answer(parent, scaffold, sampled, logprobs):
    return MessageNode(
        parent=parent,
        message=AssistantMessage(content="y"),
        token_ids=scaffold + sampled,
        mask=[False] * len(scaffold) + [True] * len(sampled),
        logprobs=logprobs,
        sampled=True,
    )


def trace(name: str, nodes, reward: float, trainable: bool = True) -> Trace:
    made = Trace(
        task=TraceTask(type="T", data=vf.TaskData(prompt="abc")),
        agent=AgentInfo(config=AgentConfig(), name=name, trainable=trainable),
        nodes=nodes,
        ok=True,
    )
    made.record_reward("reversal", reward)
    return made


def call(prompt_ids, answer_ids, version, end=None) -> CallRecord:
    body = {"choices": [{"token_ids": answer_ids}]}
    return CallRecord("http://e", prompt_key(prompt_ids), body, version, version if end is None else end, 1, 0.0)


def calls_of(*pairs) -> dict:
    out = {}
    for made, records in pairs:
        out[made.id] = Rollout(pin=REQ.group_id, calls=records)
    return out


def convert(traces, calls, ok=True):
    episode = Episode(task=traces[0].task if traces else TraceTask(type="T", data=vf.TaskData()), traces=traces, ok=ok)
    tally = Tally()
    return completion(REQ, episode, calls, 1.0, tally), tally


def split_trace() -> Trace:
    """Two turns whose second prompt does not extend the first answer: two branches."""
    return trace(
        "agent",
        [
            prompt(None, [1, 2, 3]),
            answer(0, [4], [5, 6], [-0.5, -0.25]),
            prompt(None, [1, 2, 3, 9]),
            answer(2, [4], [7], [-0.125]),
        ],
        0.75,
    )


def test_a_split_trace_ships_every_branch_as_a_sample_each_span_at_its_calls_version():
    made = split_trace()
    records = [call([1, 2, 3, 4], [5, 6], 3), call([1, 2, 3, 9, 4], [7], 4)]
    done, tally = convert([made], calls_of((made, records)))
    assert done.samples == ((6, 2), (6, 1)) and done.agents == () and done.reward == 0.75
    assert list(done.token_ids) == [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 4, 7]
    assert list(done.logprobs) == [0, 0, 0, 0, -0.5, -0.25, 0, 0, 0, 0, 0, -0.125]
    assert (done.policy_start, done.policy_end, done.token_versions) == (3, 4, ((3, 2), (4, 1)))
    first, second = split_episode(done)
    assert (first.policy_start, first.policy_end, second.policy_start, second.policy_end) == (3, 3, 4, 4)
    assert second.sample_id == ev.sample_id(REQ.episode_id, 1) and second.episode_id == REQ.episode_id
    assert (tally.episodes, tally.samples, tally.split, tally.multi_agent) == (1, 2, 1, 0)


def test_one_branch_of_one_trace_is_the_episode_it_always_was():
    made = trace("agent", [prompt(None, [1, 2]), answer(0, [4], [5], [-1.0])], 0.5)
    done, _ = convert([made], calls_of((made, [call([1, 2, 4], [5], 3)])))
    assert (done.samples, done.agents, done.agent_rewards, done.token_versions) == ((), (), (), ())
    assert (done.policy_start, done.policy_end, list(done.mask)) == (3, 3, [0, 0, 0, 1])


def test_several_trainable_agents_each_ship_their_samples_scored_by_their_own_reward():
    solver = split_trace()
    checker = trace("checker", [prompt(None, [8]), answer(0, [4], [6], [-2.0])], 0.25)
    user = trace("user", [prompt(None, [8]), answer(0, [4], [99], [-3.0])], 1.0, trainable=False)
    records = calls_of(
        (solver, [call([1, 2, 3, 4], [5, 6], 3), call([1, 2, 3, 9, 4], [7], 3)]),
        (checker, [call([8, 4], [6], 3)]),
        (user, [call([8, 4], [99], 3)]),
    )
    done, tally = convert([solver, user, checker], records)
    assert done.agents == ("agent", "agent", "checker") and len(done.samples) == 3
    assert done.agent_rewards == (("agent", 0.75), ("checker", 0.25))
    assert done.reward == pytest.approx(0.5)  # the mean of the trainable agents' rewards
    assert 99 not in done.token_ids  # the untrainable user's tokens are not trained
    assert [s.reward for s in split_episode(done)] == [0.75, 0.75, 0.25]
    assert (tally.samples, tally.multi_agent) == (3, 1)


def test_one_seat_playing_several_traces_names_each_by_its_order():
    first = trace("agent", [prompt(None, [1]), answer(0, [4], [5], [-1.0])], 1.0)
    second = trace("agent", [prompt(None, [1]), answer(0, [4], [6], [-1.0])], 0.0)
    done, _ = convert([first, second], calls_of((first, [call([1, 4], [5], 3)]), (second, [call([1, 4], [6], 3)])))
    assert done.agents == ("agent#1", "agent#2")
    assert done.agent_rewards == (("agent#1", 1.0), ("agent#2", 0.0))


def test_a_span_no_exact_call_answered_gives_the_episode_its_bounds_only():
    made = split_trace()
    for records in ([call([1, 2, 3, 4], [5, 6], 3)], [call([1, 2, 3, 4], [5, 6], 3), call([1, 2, 3, 9, 4], [7], 3, 5)]):
        done, _ = convert([made], calls_of((made, records)))
        assert done.token_versions == ()
        assert (done.policy_start, done.policy_end) == (3, max(c.policy_end for c in records))


def test_an_ok_episode_without_a_trainable_branch_is_a_failed_episode_with_the_reason():
    judge = trace("judge", [prompt(None, [1]), answer(0, [4], [5], [-1.0])], 1.0, trainable=False)
    with pytest.raises(VerifiersEpisodeError, match="the episode yielded no sample"):
        convert([judge], calls_of((judge, [])))


def test_a_trainable_agent_without_a_branch_still_counts_in_the_episodes_reward():
    """Whether an episode is several agents' is the env's trainable traces, not which yielded
    samples: so every episode of a group is scored alike."""
    solver = trace("solver", [prompt(None, [1]), answer(0, [4], [5], [-1.0])], 1.0)
    silent = trace("checker", [], 0.0)  # no message: no branch
    done, tally = convert([solver, silent], calls_of((solver, [call([1, 4], [5], 3)])))
    assert done.agents == ("solver",) and done.agent_rewards == (("solver", 1.0),)
    assert done.reward == 0.5 and (tally.samples, tally.multi_agent) == (1, 1)


def test_samples_that_make_no_episode_fail_it_in_one_line():
    from orchestrator.contracts import TrainingSample, episode_of_samples

    with pytest.raises(ValueError) as err:
        episode_of_samples(
            REQ,
            [TrainingSample([1, 2], [0, 1], [0.0, -1.0]), TrainingSample([], [], [])],
            reward=0.0,
            policy_start=0,
            policy_end=0,
            temperature=1.0,
        )
    assert "each is [tokens > 0" in str(err.value) and "\n" not in str(err.value)

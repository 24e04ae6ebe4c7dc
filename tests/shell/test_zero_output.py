"""The zero-output stop line says the rewards were equal only where every group's were."""

from __future__ import annotations

from array import array

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.shell.zero_output import ZeroOutputWitness


def _episode(episode_id: int, group_id: int, reward: float) -> ev.EpisodeCompleted:
    return ev.EpisodeCompleted(
        episode_id=episode_id,
        group_id=group_id,
        ok=True,
        temperature=1.0,
        policy_start=0,
        policy_end=0,
        reward=reward,
        tokens=Tokens.of(array("i", [5, 6, 7, 8]), bytes([0, 1, 1, 1]), array("f", [0.0, -0.5, -0.5, -0.5])),
    )


def _failed(episode_id: int, group_id: int) -> ev.EpisodeCompleted:
    return ev.EpisodeCompleted(
        episode_id=episode_id,
        group_id=group_id,
        ok=False,
        reward=0.0,
        temperature=1.0,
        policy_start=0,
        policy_end=0,
        error="inference: InferenceUnavailable: every inference endpoint down",
    )


def _witness(rewards_by_group: dict[int, list[float]]) -> ZeroOutputWitness:
    witness = ZeroOutputWitness()
    episode_id = 0
    for group_id, rewards in rewards_by_group.items():
        for reward in rewards:
            witness.saw(_episode(episode_id, group_id, reward))
            episode_id += 1
        witness.decided(ev.GroupSettled(group_id=group_id, admitted=False, sample_ids=[], dropped={"rejected": []}))
    return witness


def test_groups_whose_rewards_all_tie_are_said_to_be_equal():
    line = _witness({1: [0.5, 0.5], 2: [1.0, 1.0]}).cause(group_size=2, zero_output_batches=1)
    assert line.startswith("every group's rewards were equal") and "rewards 0.500..1.000" in line, line
    assert "of the last 4 scored episodes" in line


def test_a_group_whose_rewards_differed_is_not_said_to_be_equal():
    line = _witness({1: [0.5, 0.5], 2: [0.0, 1.0]}).cause(group_size=2, zero_output_batches=1)
    assert "equal, so every advantage" not in line, line
    assert "1 groups whose rewards were equal, 1 groups whose rewards differed" in line, line


def test_an_admitted_group_starts_the_tally_anew():
    witness = _witness({1: [0.0, 1.0]})
    witness.saw(_episode(10, 5, 1.0))
    witness.decided(ev.GroupSettled(group_id=5, admitted=True, sample_ids=[10]))
    witness.saw(_episode(11, 6, 0.25))
    witness.saw(_episode(12, 6, 0.25))
    witness.decided(ev.GroupSettled(group_id=6, admitted=False, sample_ids=[], dropped={"rejected": [11, 12]}))
    line = witness.cause(group_size=2, zero_output_batches=1)
    assert line.startswith("every group's rewards were equal") and "reward 0.250 in every one" in line, line


def test_groups_left_with_one_scored_episode_by_failures_are_said_to_have_failed():
    witness = _witness({1: [0.5]})
    for episode_id in range(20, 27):
        witness.saw(_failed(episode_id, group_id=1 + episode_id % 2))
    line = witness.cause(group_size=4, zero_output_batches=1)
    assert line.startswith("7 of the last 8 episodes failed, leaving no group two scored episodes"), line
    assert line.endswith("the last: inference: InferenceUnavailable: every inference endpoint down"), line
    # with groups of one, a lone reward is a tie: raising the group size is what changes it
    assert _witness({1: [0.5], 2: [0.5]}).cause(group_size=1, zero_output_batches=1).startswith("every group's")


def test_failures_that_outnumber_the_scored_episodes_are_the_cause_even_where_a_group_tied():
    """An endpoint that died mid-run: most episodes failed, and one group scored two equal rewards
    before it did; the stop line leads with the failures, not with the tie."""
    witness = _witness({1: [1.0, 1.0]})
    for episode_id in range(20, 25):
        witness.saw(_failed(episode_id, group_id=3))
    line = witness.cause(group_size=2, zero_output_batches=1)
    assert line.startswith("5 of the last 7 episodes failed, leaving 2 scored; the last: inference: "), line

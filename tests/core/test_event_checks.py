"""What an event refuses and what it normalises: values from outside (an env, an algorithm, a
trainer) are checked where they come in, and every logged row decodes back to the event that
wrote it."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core import events as ev
from orchestrator.core.arrays import PayloadError, Tokens


def episode(**fields):
    base = dict(episode_id=1, group_id=1, ok=True, reward=0.5, temperature=1.0, policy_start=0, policy_end=0)
    return ev.EpisodeCompleted(**{**base, **fields})


def test_a_number_of_another_type_is_stored_as_its_float_so_its_row_decodes_back_to_it():
    for reward in (1, np.float32(0.5), np.float64(0.25), True):
        e = episode(reward=reward, tokens=Tokens.of([1, 2], [0, 1], [0.0, -1.0]))
        assert type(e.reward) is float
        kind, data, payload = ev.encode_event(e)
        decoded = ev.decode_event(kind, data, payload)
        assert decoded == e and ev.encode_event(decoded) == (kind, data, payload)
    with pytest.raises(ValueError, match=r"episode_completed.reward must be a number, got 'x'"):
        episode(reward="x")


def test_an_env_s_episode_is_checked_before_the_log_takes_it():
    good = episode(reward=np.float64(0.5), tokens=Tokens.of(np.array([1, 2]), [0, 1], np.array([0.0, -1.0])))
    assert ev.checked_episode(good) == good
    with pytest.raises(ValueError, match=r"episode_completed: Expected `int`, got `str` - at `\$.episode_id`"):
        ev.checked_episode(episode(episode_id="3"))
    with pytest.raises(ValueError, match="sizes without arrays"):
        ev.checked_episode(episode(tokens=Tokens(2, 1)))
    with pytest.raises(ValueError, match="an episode is an EpisodeCompleted, got dict"):
        ev.checked_episode({"episode_id": 1})
    with pytest.raises(ValueError, match="agent_rewards"):
        episode(
            tokens=Tokens.of([1, 2, 3, 4], [0, 1, 0, 1], [0.0, -1.0, 0.0, -1.0]),
            samples=((2, 1), (2, 1)),
            agents=("a", "b"),
            agent_rewards=(("a", float("nan")), ("b", 1.0)),
        )


def test_an_algorithm_s_numpy_advantages_are_taken_and_a_nan_is_refused():
    result = ev.checked(ev.BackgroundFinalized, group_id=1, episode_ids=[1, 2], advantages=np.array([-0.5, 0.5]))
    assert result.advantages == [-0.5, 0.5] and all(type(a) is float for a in result.advantages)
    with pytest.raises(ValueError, match=r"background_finalized.advantages is nan"):
        ev.checked(ev.BackgroundFinalized, group_id=1, episode_ids=[1], advantages=[float("nan")])


def test_each_sample_s_sampled_tokens_are_its_part_of_the_mask():
    fields = dict(tokens=Tokens.of([1, 2, 3, 4, 5, 6], [1, 1, 0, 0, 1, 0], [0.0] * 6), samples=((3, 1), (3, 2)))
    with pytest.raises(ValueError, match="do not match the mask's sampled tokens"):
        episode(**fields)
    # A decoded row's arrays are checked when its payload is read: a sample's part too.
    good = episode(tokens=Tokens.of([1, 2, 3, 4, 5, 6], [0, 1, 0, 0, 1, 1], [0.0] * 6), samples=((3, 1), (3, 2)))
    kind, data, payload = ev.encode_event(good)
    bad_data = data.replace(b'"samples":[[3,1],[3,2]]', b'"samples":[[3,2],[3,1]]')
    bad = ev.decode_event(kind, bad_data)
    bad.tokens.attach(payload)
    from orchestrator.core.samples import split_episode

    first, _second = split_episode(bad)
    with pytest.raises(PayloadError, match="a sample with 1 sampled tokens where its episode says 2"):
        first.tokens.arrays()


@pytest.mark.parametrize(
    "data, error",
    [
        (
            b'{"episode_id":1,"group_id":1,"ok":true,"reward":0.0,"tokens":[2,5],"policy_start":0,'
            b'"policy_end":0,"temperature":1.0}',
            r"tokens \[2, 5\]: more sampled than in all",
        ),
        (
            b'{"episode_id":1,"group_id":1,"ok":true,"reward":0.0,"tokens":[-3,0],"policy_start":0,'
            b'"policy_end":0,"temperature":1.0}',
            r"Expected `int` >= 0 - at `\$.tokens\[0\]`",
        ),
        (
            b'{"episode_id":1,"group_id":1,"ok":true,"reward":0.0,"policy_start":0,"policy_end":0,'
            b'"temperature":1.0,"n_tokens":0}',
            "unknown field `n_tokens`",
        ),
    ],
)
def test_a_row_that_no_event_writes_does_not_decode(data, error):
    with pytest.raises(ValueError, match=error):
        ev.decode_event("episode_completed", data)

"""The fake env builds its events without validation: they must be exactly what validation
would have built (and each owns its arrays)."""

from __future__ import annotations

import asyncio
from array import array

import msgspec
import pytest

from orchestrator.contracts import RolloutRequest
from orchestrator.core.events import EpisodeCompleted, checked, encode_event
from orchestrator.envs.fake import FakeEnvConfig
from orchestrator.inference.fake import FakeEpisodes


@pytest.mark.parametrize("prompt_tokens, empty_rate", [(8, 0.2), (0, 0.5)])
def test_fake_env_events_pass_their_type_checks(prompt_tokens, empty_rate):
    config = FakeEnvConfig(prompt_tokens=prompt_tokens, empty_rate=empty_rate, min_tokens=1, max_tokens=6)
    env = FakeEpisodes(config, seed=3, version_now=lambda: 2)

    async def episodes():
        return [await env(RolloutRequest(i, i // 4, "fake", i // 4, 0, 2)) for i in range(300)]

    events = asyncio.run(episodes())
    for event in events:
        validated = checked(EpisodeCompleted, **msgspec.structs.asdict(event))
        assert validated == event and encode_event(validated) == encode_event(event)
    assert {len(e.token_ids) - prompt_tokens for e in events} == set(range(7))  # empty ones too
    # Packed: the arrays of one event are its own (the masks, immutable bytes, may be shared).
    assert all(type(e.token_ids) is array and e.token_ids.typecode == "i" and type(e.mask) is bytes for e in events)
    logprobs = [e.logprobs for e in events]
    assert len({id(x) for x in logprobs}) == len(logprobs)


@pytest.mark.parametrize("vocab_size", [2, 1000, 151_936])
def test_fake_env_token_ids_span_the_vocabulary(vocab_size):
    config = FakeEnvConfig(prompt_tokens=16, min_tokens=2000, max_tokens=2000, vocab_size=vocab_size)
    env = FakeEpisodes(config, seed=1, version_now=lambda: 0)
    event = asyncio.run(env(RolloutRequest(1, 1, "fake", 1, 0, 0)))
    ids = event.token_ids
    assert len(ids) == 2016 and 0 <= min(ids) and max(ids) < vocab_size
    # Drawn across the whole range, not from a byte: the top tenth of the vocabulary is used.
    assert sum(i >= vocab_size - max(1, vocab_size // 10) for i in ids) > 100

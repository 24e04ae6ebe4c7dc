"""The batch file the trainer reads: a safetensors file in canonical bytes, read without a copy."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load

from orchestrator.core import events as ev
from orchestrator.core.batch import BatchSample, decode_batch, encode_batch, sample_of
from tests.support.sim import SimWorld


def _shipped_samples():
    params = ev.CoreParams(env_ratios={"a": 1.0}, group_size=4, batch_size=8, max_inflight=8, max_steps=3)
    world = SimWorld(params, seed=3)
    world.start()
    while not world.state.shipped_batches and world.advance():
        pass
    samples = [s for batch in world.state.shipped_batches.values() for s in batch]
    assert samples
    return samples


def test_a_batch_file_holds_its_samples_and_any_safetensors_reader_opens_it():
    shipped = _shipped_samples()
    payload = encode_batch(7, [sample_of(s.trace, s.env, s.advantage, s.lag, s.weight) for s in shipped])
    batch = decode_batch(payload)
    assert batch.step == 7 and len(batch) == len(shipped) and batch.envs == [s.env for s in shipped]
    for i, s in enumerate(shipped):
        span = batch.tokens(i)
        assert batch.token_ids[span].tolist() == s.trace.token_ids.tolist()
        assert batch.mask[span].tobytes() == s.trace.mask
        assert batch.logprobs[span].tobytes() == s.trace.logprobs.tobytes()
        assert (batch.sample_id[i], batch.advantage[i], batch.lag[i]) == (s.trace.trace_id, s.advantage, s.lag)
    # Views of the bytes, not copies.
    assert not batch.token_ids.flags.owndata and not batch.token_ids.flags.writeable
    tensors = load(payload)
    assert np.array_equal(tensors["token_ids"], batch.token_ids) and np.array_equal(tensors["offsets"], batch.offsets)
    # Canonical: the same samples give the same bytes (the log's sha256 of a re-written file matches).
    assert encode_batch(7, [sample_of(s.trace, s.env, s.advantage, s.lag, s.weight) for s in shipped]) == payload


def test_an_empty_batch_and_rewards_round_trip():
    assert len(decode_batch(encode_batch(1, []))) == 0
    sample = BatchSample(1, 1, "a", [5, 6], [0, 1], [0.0, -1.0], 0.5, 0, 0, 1.0, reward=0.25)
    assert decode_batch(encode_batch(1, [sample])).reward.tolist() == [0.25]
    assert decode_batch(encode_batch(1, [sample._replace(reward=None)])).reward is None


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (lambda b: b[:5], "shorter than a safetensors header"),
        (lambda b: b[:-3], "outside the file"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length"),
        (lambda b: b[:8] + b"[" + b[9:], "does not parse"),
    ],
)
def test_a_damaged_batch_file_is_one_line(damage, fragment):
    payload = encode_batch(1, [BatchSample(1, 1, "a", [5, 6], [0, 1], [0.0, -1.0], 0.5, 0, 0, 1.0)])
    with pytest.raises(ValueError, match=fragment) as info:
        decode_batch(damage(payload))
    assert "\n" not in str(info.value)

"""The batch file the trainer reads: canonical bytes (orjson, sorted keys)."""

from __future__ import annotations

import orjson

from orchestrator.core import events as ev
from orchestrator.core.batch import encode_batch, sample_record
from orchestrator.sim import SimWorld


def test_batch_files_are_written_with_sorted_keys_as_built():
    params = ev.CoreParams(env_ratios={"a": 1.0}, group_size=4, batch_size=8, max_inflight=8, max_steps=3)
    world = SimWorld(params, seed=3)
    world.start()
    while not world.state.shipped_batches and world.advance():
        pass
    samples = [s for batch in world.state.shipped_batches.values() for s in batch]
    assert samples
    payload = encode_batch(7, (sample_record(s.trace, s.env, s.advantage, s.lag) for s in samples))
    # Built in sorted order rather than sorted by orjson: the bytes must be the sorted encoding.
    assert payload == orjson.dumps(orjson.loads(payload), option=orjson.OPT_SORT_KEYS)
    assert list(orjson.loads(payload)) == ["format", "samples", "step"]

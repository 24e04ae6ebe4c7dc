"""A trace's per-token policy versions (`EpisodeCompleted.token_versions`, docs/rules.md "A token's
version"): canonical runs, refused when they do not fit the trace, through the log's encoding
and into the batch file's per-token `version`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.batch import decode_batch, encode_batch, sample_of


def trace(mask: list[int], runs=(), start: int = 0, end: int = 0) -> ev.EpisodeCompleted:
    return ev.EpisodeCompleted(
        episode_id=1,
        group_id=0,
        ok=True,
        reward=0.0,
        temperature=1.0,
        tokens=Tokens.of(list(range(len(mask))), mask, [-0.5 * m for m in mask]),
        policy_start=start,
        policy_end=end,
        token_versions=runs,
    )


def test_runs_are_canonical_and_a_single_version_has_none():
    assert ev.version_runs([(3, 2), (3, 0), (3, 4)]) == ()
    assert ev.version_runs([(3, 2), (4, 0), (3, 1), (5, 2), (5, 1)]) == ((3, 3), (5, 3))


@pytest.mark.parametrize(
    ("runs", "start", "end", "message"),
    [
        (((3, 4),), 3, 3, "not runs of two or more versions"),
        (((3, 2), (3, 2)), 3, 3, "not runs of two or more versions"),
        (((3, 2), (4, 0), (5, 2)), 3, 5, "not runs of two or more versions"),
        (((3, 2), (4, 3)), 3, 4, "count 5 tokens where 4 were sampled"),
        (((3, 2), (4, 2)), 2, 4, "span versions 3..4, the episode says 2..4"),
    ],
)
def test_runs_that_do_not_fit_the_trace_are_refused_in_one_line(runs, start, end, message):
    with pytest.raises(ValueError, match=message):
        trace([0, 0, 1, 1, 1, 1], runs, start, end)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), max_size=6), st.integers(0, 3))
def test_runs_travel_through_the_log_and_into_the_batch_file_token_by_token(segments, prompt):
    runs = ev.version_runs(segments)
    versions = [v for v, n in segments for _ in range(n)]
    mask = [0] * prompt + [1] * len(versions)
    start, end = (min(versions), max(versions)) if versions else (0, 0)
    event = trace(mask, runs, start, end)
    kind, data, payload = ev.encode_event(event)
    assert (b"token_versions" in data) == bool(runs)  # a trace of one version logs what it always did
    assert ev.decode_event(kind, data, payload) == event
    batch = decode_batch(encode_batch(1, [sample_of(event, "e", 0.0, 0, 1.0)]))
    assert batch.version.tolist() == [-1] * prompt + (versions if len(set(versions)) > 1 else [start] * len(versions))
    assert np.all((batch.version >= 0) == (batch.mask == 1))

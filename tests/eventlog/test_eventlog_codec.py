"""Payload validation: NaN/Infinity and non-JSON values are refused, the rest round-trips."""

from __future__ import annotations

import dataclasses
import datetime
import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import InvalidEventError, canonical_json
from eventlog.codec import encode, has_nonfinite

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats()  # includes NaN and +/-inf
    | st.text(max_size=8)
    | st.sampled_from(["null", "NaN", "Infinity"])
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner, max_size=6),
    max_leaves=15,
)


def reference_nonfinite(obj) -> bool:
    """Obviously-correct (slow) walk, the oracle for the fast check."""
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, dict):
        return any(reference_nonfinite(v) for v in obj.values())
    if isinstance(obj, list):
        return any(reference_nonfinite(v) for v in obj)
    return False


@settings(max_examples=120, deadline=None)
@given(json_like)
def test_encode_refuses_exactly_the_nonfinite(value):
    if reference_nonfinite(value):
        assert has_nonfinite(value)
        with pytest.raises(InvalidEventError):
            encode(value)
        with pytest.raises(InvalidEventError):
            canonical_json(value)
    else:
        assert not has_nonfinite(value)
        assert orjson.loads(encode(value)) == value
        assert orjson.loads(canonical_json(value)) == value


@pytest.mark.parametrize(
    "value, bad",
    [
        ([1e308, 1e308, 1.0], False),  # the sum overflows, the elements are finite
        ([1e308, 1e308, float("inf")], True),
        ([float("inf"), -float("inf")], True),  # sums to NaN
        ([1, 2, True, 3.5], False),
        ([1, "x", float("nan")], True),
        ({"a": [[1.0], [2.0, float("-inf")]]}, True),
        ((1.0, float("nan")), True),
    ],
)
def test_has_nonfinite_edge_cases(value, bad):
    assert has_nonfinite(value) is bad


@dataclasses.dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    "value",
    [{"t": datetime.datetime(2024, 1, 1)}, Point(1), {"k": {1, 2}}, {(1, 2): 3}, b"raw", 2**64],
)
def test_values_that_would_not_round_trip_are_refused(value):
    with pytest.raises(InvalidEventError):
        encode(value)


def test_canonical_json_is_key_order_independent():
    a = {"x": 1, "y": [{"b": 2, "a": 1}]}
    b = {"y": [{"a": 1, "b": 2}], "x": 1}
    assert canonical_json(a) == canonical_json(b) == b'{"x":1,"y":[{"a":1,"b":2}]}'

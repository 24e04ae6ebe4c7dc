"""JSON encoding of event payloads.

orjson is fast but encodes NaN and +/-Infinity as ``null`` instead of failing,
which would silently change a value on replay.  Every non-finite float is
encoded as ``null``, so a document without the bytes ``null`` cannot have held
one: the structural walk below only runs for documents that contain ``null``
(legitimate ``None`` values or strings containing "null").  That keeps the
common path at one ``bytes.__contains__`` per event.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from .errors import InvalidEventError

__all__ = ["encode", "canonical_json", "has_nonfinite", "OPTS", "NOT_JSON", "NONFINITE"]

# datetime and dataclasses would encode to something that decodes as a
# different type (str / dict); refuse them so a replayed payload equals the
# appended one.  Non-str dict keys and ints beyond 64 bits fail by default.
OPTS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
CANONICAL_OPTS = OPTS | orjson.OPT_SORT_KEYS
_dumps = orjson.dumps
NOT_JSON = "event data is not JSON-serializable"
NONFINITE = "event data contains NaN or Infinity, which JSON cannot represent"


_SCALARS = frozenset({str, int, bool, type(None)})


def has_nonfinite(obj: Any) -> bool:
    """True if ``obj`` (a decoded-JSON-like structure) holds a NaN or infinite float."""
    if type(obj) is dict:  # the usual event payload: skip one level of the walk
        return _any_nonfinite(obj.values())
    return _any_nonfinite((obj,))


def _any_nonfinite(values: Iterable[Any]) -> bool:
    """Walk values with an inline loop: scalars cost no Python call of their own."""
    for v in values:
        t = type(v)
        if t in _SCALARS:
            continue
        if t is float:
            if v - v != 0.0:  # NaN - NaN and inf - inf are NaN
                return True
        elif t is dict:
            if _any_nonfinite(v.values()):
                return True
        elif t is list or t is tuple:
            if _seq_has_nonfinite(v):
                return True
        elif isinstance(v, float):  # float subclasses, e.g. a float-valued Enum
            if v - v != 0.0:
                return True
        elif isinstance(v, dict):
            if _any_nonfinite(v.values()):
                return True
        elif isinstance(v, (list, tuple)) and _seq_has_nonfinite(v):
            return True
    return False


def _seq_has_nonfinite(seq: list | tuple) -> bool:
    """Check a list; numeric lists (token ids, logprobs) take one C-level sum()."""
    try:
        total = sum(seq)
    except (TypeError, OverflowError):  # not all (small) numbers: walk it
        return _any_nonfinite(seq)
    # A finite total proves every element finite; an infinite one may be a
    # mere overflow of large finite floats, so decide element by element.
    if total - total == 0:
        return False
    return _any_nonfinite(seq)


def encode(data: Any) -> bytes:
    """Encode an event payload as JSON bytes; raise InvalidEventError if it is not plain JSON."""
    try:
        doc = _dumps(data, option=OPTS)
    except TypeError as e:  # orjson.JSONEncodeError is a TypeError
        raise InvalidEventError(f"{NOT_JSON}: {e}") from None
    if b"null" in doc and has_nonfinite(data):
        raise InvalidEventError(NONFINITE)
    return doc


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes of ``obj`` (sorted keys, compact, orjson) for hashing.

    Raises InvalidEventError for values that are not plain JSON, NaN/Infinity included,
    so two different values never share a hash through ``null``.
    """
    try:
        doc = _dumps(obj, option=CANONICAL_OPTS)
    except TypeError as e:
        raise InvalidEventError(f"value is not JSON-serializable: {e}") from None
    if b"null" in doc and has_nonfinite(obj):
        raise InvalidEventError("value contains NaN or Infinity, which JSON cannot represent")
    return doc

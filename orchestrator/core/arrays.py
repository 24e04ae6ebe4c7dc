"""A trace's token arrays, packed: token ids (int32), sampled mask (one byte each in memory, one
bit each in the log) and logprobs (float32), never a Python object per token.

In memory a trace holds `array("i")` token ids, `bytes` of 0/1 for the mask and `array("f")`
logprobs: 9 bytes per token, compared with equality like lists, read without a copy by numpy
(`np.frombuffer`). In the log they travel as one payload (`pack`, docs/log-format.md):

    token ids   n x int32, little-endian
    logprobs    n x float32, little-endian
    mask        ceil(n / 8) bytes, bit i of the mask is bit (i % 8) of byte i // 8 (little bit order)

Every array comes in through the `as_*` functions (the boundary: the validators of
`EpisodeCompleted`): a NaN or infinite logprob, a mask value other than 0 or 1 or a token id
outside int32 is refused there with a one-line ValueError.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import numpy as np

TOKEN_ID_CODE, LOGPROB_CODE = "i", "f"
assert array(TOKEN_ID_CODE).itemsize == 4 and array(LOGPROB_CODE).itemsize == 4, "int32 and float32 arrays"
_LITTLE = sys.byteorder == "little"
_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")


class PayloadError(ValueError):
    """A payload that does not hold the arrays its event says (length, damage)."""


def _ndarray(value: Any, what: str) -> np.ndarray:
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be a list of numbers: {' '.join(str(err).split())}") from None


def as_token_ids(value: Any) -> array:
    """Token ids as an int32 array (from a list, an array or a numpy array of ints)."""
    if type(value) is array and value.typecode == TOKEN_ID_CODE:
        return value
    ids = _ndarray(value, "token_ids")
    if ids.size == 0:
        return array(TOKEN_ID_CODE)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be a flat list of ints, got {ids.dtype} of shape {ids.shape}")
    if ids.min() < -(2**31) or ids.max() >= 2**31:
        raise ValueError("token_ids must fit in int32")
    return array(TOKEN_ID_CODE, ids.astype(np.int32).tobytes())


def as_logprobs(value: Any) -> array:
    """Logprobs as a float32 array; a NaN or an infinite one (or one beyond float32) is refused."""
    if type(value) is array and value.typecode == LOGPROB_CODE:
        packed = np.frombuffer(value, dtype=np.float32)
    else:
        floats = _ndarray(value, "logprobs")
        if floats.size and (floats.ndim != 1 or floats.dtype.kind not in "iuf"):
            raise ValueError(f"logprobs must be a flat list of floats, got {floats.dtype} of shape {floats.shape}")
        with np.errstate(over="ignore"):  # beyond float32: infinite, refused below
            packed = floats.astype(np.float32)
        value = array(LOGPROB_CODE, packed.tobytes())
    finite = np.isfinite(packed)
    if not finite.all():
        at = int(np.argmin(finite))
        raise ValueError(f"logprobs[{at}] is {packed[at]}: every logprob must be finite (no NaN or infinity)")
    return value


def as_mask(value: Any) -> bytes:
    """The sampled mask as bytes of 0 and 1."""
    if type(value) is bytes or isinstance(value, (list, tuple)):
        try:
            mask = bytes(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"mask must be a list of 0 and 1: {err}") from None
        if mask and max(mask) > 1:
            raise ValueError(f"mask values must be 0 or 1, got {max(mask)}")
        return mask
    flags = _ndarray(value, "mask")
    if flags.size and (flags.ndim != 1 or flags.dtype.kind not in "biu" or flags.min() < 0 or flags.max() > 1):
        raise ValueError("mask must be a flat list of 0 and 1")
    return flags.astype(np.uint8).tobytes()


def payload_size(n_tokens: int) -> int:
    return 8 * n_tokens + (n_tokens + 7) // 8


def pack(token_ids: array, mask: bytes, logprobs: array) -> bytes:
    """The log payload of a trace's arrays (see the module doc); b"" for no token."""
    if not token_ids:
        return b""
    if _LITTLE:
        ids, lps = token_ids.tobytes(), logprobs.tobytes()
    else:  # the payload is little-endian wherever it is written
        ids = np.frombuffer(token_ids, dtype=np.int32).astype(_INT32).tobytes()
        lps = np.frombuffer(logprobs, dtype=np.float32).astype(_FLOAT32).tobytes()
    bits = np.packbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little").tobytes()
    return b"".join((ids, lps, bits))


def unpack(payload: bytes | memoryview | None, n_tokens: int) -> tuple[array, bytes, array]:
    """(token ids, mask, logprobs) of a payload of `n_tokens` tokens; PayloadError if its size
    is not the one `n_tokens` makes."""
    payload = payload or b""
    if len(payload) != payload_size(n_tokens):
        raise PayloadError(
            f"a payload of {len(payload)} bytes for {n_tokens} tokens (expected {payload_size(n_tokens)})"
        )
    view = memoryview(payload)
    ids, lps = array(TOKEN_ID_CODE), array(LOGPROB_CODE)
    ids.frombytes(view[: 4 * n_tokens])
    lps.frombytes(view[4 * n_tokens : 8 * n_tokens])
    if not _LITTLE:
        ids.byteswap()
        lps.byteswap()
    bits = np.frombuffer(view[8 * n_tokens :], dtype=np.uint8)
    mask = np.unpackbits(bits, count=n_tokens, bitorder="little").tobytes()
    return ids, mask, lps

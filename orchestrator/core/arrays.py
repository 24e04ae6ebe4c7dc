"""A trace's token arrays, packed: token ids (int32), sampled mask (one byte each in memory, one
bit each in the log) and logprobs (float32), never a Python object per token.

In memory a trace holds `array("i")` token ids, `bytes` of 0/1 for the mask and `array("f")`
logprobs: 9 bytes per token, compared with equality like lists, read without a copy by numpy
(`np.frombuffer`). In the log they travel as one payload (`pack`, docs/log-format.md):

    token ids   n x int32, little-endian
    logprobs    n x float32, little-endian
    mask        ceil(n / 8) bytes, bit i of the mask is bit (i % 8) of byte i // 8 (little bit order)

An event holds them as `Tokens`: their sizes, logged in the row's JSON, and the arrays, which
are the row's payload, unpacked when first read. Every array comes in through `Tokens.of` and
the `as_*` functions it calls (the boundary): a NaN or infinite logprob, a mask value other than
0 or 1 or a token id outside int32 is refused there with a one-line ValueError.
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated, Any, ClassVar

import msgspec
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
    """The log payload of an episode's arrays (see the module doc); b"" for no token."""
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


class Tokens(msgspec.Struct, array_like=True, dict=True, eq=False):
    """An episode's (or a sample's) token arrays as its event holds them: their sizes, which the
    row's JSON logs as `[n_tokens, sampled_tokens]`, and the arrays, which travel as the row's
    payload and are unpacked when first read. A fold reads only the payloads of the traces it
    still holds at its end (`attach`, by `seq`): until then a trace costs its sizes alone."""

    # Checked in msgspec's decoder; that there are no more sampled tokens than tokens, by the event
    # that holds them (`EpisodeCompleted`), one comparison rather than a call per row.
    n_tokens: Annotated[int, msgspec.Meta(ge=0)]
    sampled_tokens: Annotated[int, msgspec.Meta(ge=0)]

    @classmethod
    def of(cls, token_ids: Any, mask: Any, logprobs: Any) -> Tokens:
        """The arrays of an episode, checked (the `as_*` functions) and aligned."""
        ids, flags, lps = as_token_ids(token_ids), as_mask(mask), as_logprobs(logprobs)
        if not len(ids) == len(flags) == len(lps):
            raise ValueError("token_ids, mask and logprobs must have the same length")
        tokens = cls(len(ids), flags.count(1))
        tokens.__dict__["_arrays"] = (ids, flags, lps)
        return tokens

    # The log row whose payload holds the arrays: set by a fold on each row it decodes, and
    # taken by a sample's part from its episode's (None: not from a fold). An attribute of the
    # instance, not a property: a fold sets it once a row.
    seq: ClassVar[int | None] = None

    def attach(self, payload: bytes | None) -> None:
        """Take the arrays from their row's payload (checked when first read: PayloadError); a
        sample's part, from its episode's."""
        if "_slice" in self.__dict__:
            self.__dict__["_slice"][0].attach(payload)
        else:
            self.__dict__["_payload"] = payload

    def in_memory(self) -> bool:
        """Are its arrays unpacked (or made here), not left to be read from a payload?"""
        return "_arrays" in self.__dict__

    def arrays(self) -> tuple[array, bytes, array]:
        """(token ids, mask, logprobs); PayloadError if a payload was attached that does not hold
        them, or none was (a trace read before its fold read its payload)."""
        held = self.__dict__
        if "_arrays" not in held:
            if "_slice" in held:
                whole, start = held["_slice"]
                ids, mask, lps = whole.arrays()
                end = start + self.n_tokens
                if (sampled := mask[start:end].count(1)) != self.sampled_tokens:
                    raise PayloadError(
                        f"a sample with {sampled} sampled tokens where its episode says {self.sampled_tokens}"
                    )
                held["_arrays"] = (ids[start:end], mask[start:end], lps[start:end])
                del held["_slice"]  # its own arrays now: the episode's may go
            elif self.n_tokens == 0:
                held["_arrays"] = (array(TOKEN_ID_CODE), b"", array(LOGPROB_CODE))
            elif "_payload" not in held:
                raise PayloadError("the payload of its event was not read")
            else:
                ids, mask, lps = unpack(held["_payload"], self.n_tokens)
                if mask.count(1) != self.sampled_tokens:
                    raise PayloadError(
                        f"a payload with {mask.count(1)} sampled tokens where its event says {self.sampled_tokens}"
                    )
                held["_arrays"] = (ids, mask, lps)
                del held["_payload"]  # unpacked: the packed bytes need not stay too
        return held["_arrays"]

    def packed(self) -> bytes:
        """The payload of the arrays (`pack`)."""
        return pack(*self.arrays())

    def part(self, start: int, n_tokens: int, sampled_tokens: int) -> Tokens:
        """The `n_tokens` tokens from `start`: a sample's arrays, read from its episode's when
        first read."""
        part = Tokens(n_tokens, sampled_tokens)
        part.__dict__["_slice"] = (self, start)
        part.__dict__["seq"] = self.seq
        return part

    @property
    def token_ids(self) -> array:
        return self.arrays()[0]

    @property
    def mask(self) -> bytes:
        return self.arrays()[1]

    @property
    def logprobs(self) -> array:
        return self.arrays()[2]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokens):
            return NotImplemented
        return (self.n_tokens, self.sampled_tokens) == (other.n_tokens, other.sampled_tokens) and (
            self.arrays() == other.arrays()
        )

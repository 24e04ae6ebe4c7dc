"""Server-sent events read from a byte stream by their own rules (the HTML standard's
"event stream" parsing), as the inference client's streamed completions need them.

A line ends at CR, LF or CRLF and nowhere else: a token whose text holds U+2028, U+2029 or
U+0085 (which `str.splitlines` would split at) stays inside its chunk. Lines are split as bytes,
before any decoding: CR and LF never occur inside a multi-byte UTF-8 sequence, so a character
split across two reads is joined again before its line is parsed. A CRLF split across two reads
ends one line, not two. An event is dispatched at a blank line; its ``data`` is every ``data:``
field of it joined by LF (a single space after the colon dropped); comments (``:``) and the other
fields (``event``, ``id``, ``retry``) are not needed here and skipped; an event the stream did not
end with a blank line is dropped, as the standard says.
"""

from __future__ import annotations

BOM = b"\xef\xbb\xbf"


class EventStreamDecoder:
    """Feed it the stream's bytes as they come; it gives the data of each complete event."""

    __slots__ = ("_partial", "_after_cr", "_data", "_started")

    def __init__(self) -> None:
        self._partial = b""  # the current line's bytes so far (no line end seen yet)
        self._after_cr = False  # the last read ended with CR: an LF starting the next ends nothing
        self._data: list[bytes] = []  # the current event's data fields
        self._started = False  # past the stream's first bytes (where a BOM is dropped)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of each event that `chunk` completes (in order; none if it completes none)."""
        if not chunk:
            return []
        if self._after_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._after_cr = False
        if self._partial:
            chunk = self._partial + chunk
        if not self._started:
            if BOM.startswith(chunk) and len(chunk) < len(BOM):  # maybe a BOM split across reads
                self._partial = chunk
                return []
            self._started = True
            if chunk.startswith(BOM):
                chunk = chunk[len(BOM) :]
        # bytes.splitlines breaks at CR, LF and CRLF only (unlike str.splitlines), dropping them
        lines = chunk.splitlines()
        if lines and chunk[-1:] not in (b"\n", b"\r"):  # its last line is not ended yet
            self._partial = lines.pop()
        else:
            self._partial = b""
        self._after_cr = chunk[-1:] == b"\r"
        events: list[bytes] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    events.append(b"\n".join(data))
                    data.clear()
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value[:1] == b" " else value)
            elif line == b"data":
                data.append(b"")
        return events

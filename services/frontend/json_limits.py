"""Limits every JSON request body is checked against before it is decoded.

msgspec decodes nested values by recursion, also the values of unknown fields it skips:
an object nested ~1,000 deep hits Python's recursion limit (a RecursionError, a 500),
and invalid UTF-8 raises UnicodeDecodeError. Both are the client's mistake and get a
400 that names the problem. (The body's size is limited earlier, while it is read:
`sse.read_body`, 413.)

The depth is counted on the body with its strings blanked out, so brackets inside
strings do not count; numpy keeps the scan linear in C for a body of megabytes.
"""

from __future__ import annotations

import re

import numpy as np

from kvflow.errors import InvalidRequestError

# OpenAI's request shapes nest < 10 deep; JSON schemas in response_format a few dozen.
MAX_JSON_DEPTH = 128
# A JSON string: quotes around runs of anything but quotes and backslashes, separated by
# escapes. Written as runs ("unrolled"), not one alternation a character: a base64 image
# of a megabyte then takes ~10 ms to skip instead of ~200 ms, in the event loop.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets


def check_json_limits(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise InvalidRequestError if `body` is not UTF-8 or nests deeper than `max_depth`."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid UTF-8 (byte {exc.start}: "
            f"{body[exc.start : exc.start + 1]!r})"
        ) from None
    depth = json_depth(body)
    if depth > max_depth:
        raise InvalidRequestError(
            f"the request body nests {depth} levels deep; the limit is {max_depth}"
        )


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects (0 for a scalar)."""
    if b"[" not in body and b"{" not in body:
        return 0
    brackets = _STRING.sub(b"", body).translate(None, _BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())

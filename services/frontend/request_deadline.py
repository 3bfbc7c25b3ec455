"""A request's own time limit: after it the request is aborted (its KV blocks freed) and
the client gets a 408 `timeout` error (in-band, if its stream had started).

Two sources, the shorter one wins:
- the body field `timeout` (seconds, kvflow's extension): the whole request, streamed
  or not;
- the header `X-Stainless-Read-Timeout`, which the `openai` Python client sends with its
  `timeout` (600 s by default). It is the client's *read* timeout: the client gives up
  when no byte arrives for that long. A non-streamed response sends nothing until it is
  done, so there it bounds the whole request; a stream is bounded until its first
  chunk (after that, chunks arrive far more often than any read timeout).
A client that gives up and disconnects is noticed anyway (sse.py); the deadline also
frees the engine when a proxy keeps the connection open.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvflow.errors import InvalidRequestError, RequestTimeoutError

READ_TIMEOUT_HEADER = "x-stainless-read-timeout"


@dataclass(frozen=True)
class Deadline:
    """Seconds allowed, and when they end on the event loop's clock."""

    seconds: float
    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(seconds, asyncio.get_running_loop().time() + seconds)

    def remaining(self) -> float:
        return max(self.at - asyncio.get_running_loop().time(), 0.0)

    def error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the request did not finish within its timeout of {self.seconds:g} s; aborted"
        )


@dataclass(frozen=True)
class RequestDeadlines:
    whole: Deadline | None  # the whole request
    first_chunk: Deadline | None  # until the response starts


def request_deadlines(
    body_timeout: float | None, headers: Mapping[str, str], stream: bool
) -> RequestDeadlines:
    """The deadlines of a request arriving now (call on the event loop)."""
    read_timeout = _header_seconds(headers.get(READ_TIMEOUT_HEADER))
    whole = body_timeout
    if read_timeout is not None and not stream:
        whole = read_timeout if whole is None else min(whole, read_timeout)
    first = read_timeout if stream else None
    if first is not None and whole is not None and whole <= first:
        first = None  # the whole-request deadline comes first anyway
    return RequestDeadlines(
        Deadline.after(whole) if whole is not None else None,
        Deadline.after(first) if first is not None else None,
    )


def _header_seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidRequestError(
            f"{READ_TIMEOUT_HEADER} must be a positive number of seconds, got {value!r}"
        )
    return seconds

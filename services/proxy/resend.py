"""The proxy's resend rules (sans-IO): when a decode instance fails a request, is it
run again, and after how long?

A request is resent only while the client has received nothing of its answer: the
proxy holds back a non-streamed answer until it has it whole, and a stream's status
line until its first chunk. A stream that drops after that is resumed (resume.py)
under the same bounds, each resume counting as a `dropped` resend. What failed
decides the bound:

- `unreachable`: the connection was refused or never opened (the instance is down or
  restarting). Nothing reached it. Once every decode instance has refused, a prefill
  instance serves the request whole (`prefill_fallback`); while that fails too, the
  proxy waits for one to come back, backing off, for at most `wait_s` since the
  request's first failure.
- `dropped`: the connection broke after the request was sent (the instance died
  holding it), or `status`: a 5xx that a dying or recovering engine gives (500, 502,
  503, 504). The prompt is prefilled again and the request resent, at most
  `max_resends` times and within the same `wait_s`.

A 4xx is the client's, never resent; neither is a timeout (`--timeout`: the instance
is alive but slow, and a resend would double its load) nor a 501/505 (the instance
cannot serve that request at all).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import httpx


class Failure(enum.Enum):
    UNREACHABLE = "unreachable"
    DROPPED = "dropped"
    STATUS = "status"


# 5xx statuses a dead, dying or recovering engine answers; the others are final.
RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})


def failure_of_status(status: int) -> Failure | None:
    """The failure a decode instance's status stands for; None for an answer to relay."""
    return Failure.STATUS if status in RETRYABLE_STATUSES else None


def failure_of_error(exc: httpx.HTTPError) -> Failure | None:
    """The failure an httpx error stands for; None for one that is not resent."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return Failure.UNREACHABLE
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return Failure.DROPPED
    return None  # timeouts, a closed pool, an invalid URL: not an instance's death


@dataclass(frozen=True)
class ResendPolicy:
    max_resends: int = 3  # dropped or 5xx: sends after the first
    wait_s: float = 60.0  # since the first failure, for every kind
    backoff_s: float = 0.25  # first pause; doubles after each failure
    max_backoff_s: float = 2.0
    # Every decode instance refused: send the request whole to a prefill instance.
    prefill_fallback: bool = True

    def __post_init__(self) -> None:
        if self.max_resends < 0 or self.wait_s < 0:
            raise ValueError("--resend-max and --resend-wait must not be negative")

    def delay(self, failure: Failure, failures: int, resends: int, waited_s: float) -> float | None:
        """Seconds to pause before the next send, or None to give up. `failures` counts
        this request's failures so far (this one included), `resends` the dropped and
        5xx ones among them, `waited_s` the time since its first failure."""
        if failure is not Failure.UNREACHABLE and resends > self.max_resends:
            return None
        pause = min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1))
        if waited_s + pause > self.wait_s:
            return None
        return pause

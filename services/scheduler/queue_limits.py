"""Load shedding on the engine's waiting queue: how many requests may wait, and how long.

    add_request ─▶ check_room(len(waiting)) ─▶ QueueFullError   (HTTP 429, Retry-After)
    each step's update ─▶ expired(waiting, now) ─▶ failed with QueueTimeoutError (503)

Both count what waits for its *first* step: a request preempted by recompute goes back
to the queue, but it has streamed tokens already, so it never expires (it still counts
as waiting for the room check: the engine is no less busy). Each of a request's n
samples is one engine request, so one n=4 request needs 4 places.

The expiry scan is skipped until the oldest queued request could have expired: arrivals
are added in time order, so one deadline (the oldest's) is enough to remember.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvflow.errors import QueueFullError, QueueTimeoutError
from kvflow.services.scheduler.request import Request, RequestStatus


class QueueLimits:
    def __init__(self, max_waiting: int | None, max_delay_s: float | None) -> None:
        self.max_waiting = max_waiting
        self.max_delay_s = max_delay_s
        self._next_expiry = math.inf  # no waiting request can expire before this

    def check_room(self, num_waiting: int) -> None:
        """Raise QueueFullError when one more request would exceed max_waiting."""
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            raise QueueFullError(
                f"the server is overloaded: {num_waiting} requests already wait "
                f"(max_waiting_requests={self.max_waiting}); retry later"
            )

    def on_added(self, queued_time: float) -> None:
        if self.max_delay_s is not None and math.isinf(self._next_expiry):
            self._next_expiry = queued_time + self.max_delay_s

    def expired(self, waiting: Iterable[Request], now: float) -> list[str]:
        """Ids of the requests that waited for their first step longer than allowed."""
        if self.max_delay_s is None or now < self._next_expiry:
            return []
        limit = self.max_delay_s
        expired, oldest_left = [], math.inf
        for request in waiting:
            if request.status != RequestStatus.WAITING:
                continue  # preempted: it has run before
            if now - request.arrival_time > limit:
                expired.append(request.request_id)
            else:
                oldest_left = min(oldest_left, request.arrival_time)
        self._next_expiry = oldest_left + limit
        return expired

    def timeout_error(self) -> QueueTimeoutError:
        return QueueTimeoutError(
            f"the server is overloaded: the request waited more than {self.max_delay_s} s "
            "(max_queue_delay) for its turn; retry later"
        )

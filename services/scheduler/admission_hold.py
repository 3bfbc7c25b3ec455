"""Admission hold: waiting prompts wait a moment for the arrivals that are due, so that a
wave of prompts is prefilled in one step instead of a lone prompt paying a step of its own.

Closed-loop clients (a chat UI, a load test at fixed concurrency) send their next
request as soon as the previous one finished. When 8 such clients start together, the
first arrival is often prefilled alone and the other 7 one step later; from then on the
two groups finish one step apart, and every wave is split 1 + 7 again: the lone prompt
rides on the 7's last decode step, and the 7 on the lone one's first decode.

The rule (`--admission-hold SECONDS`, the most a prompt is held; 0 turns it off):
the waiting queue's head is not admitted while arrivals are due, i.e.

    requests that finished within the hold window, plus running requests whose
    this-step sample is their last (max_tokens), outnumber the requests that arrived
    since the oldest of those finishes,

and the head has waited less than the hold. A finish predicts an arrival only for
closed-loop load: when none comes, the head goes at the hold's end, so the hold bounds
what a prompt can lose. Offline batches put every prompt in the queue before the first
step and are never held (nothing finished yet, and a prompt that waits behind the
batch's budget is admitted as usual once the hold window is past).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import StepBuilder, StepFeature


class AdmissionHoldFeature(StepFeature):
    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._arrived: dict[str, float] = {}  # waiting request -> when it arrived
        self._num_arrivals = 0  # every arrival so far
        # (time, arrivals before it) of each finish within the window
        self._finishes: deque[tuple[float, int]] = deque()
        self._finishing_now = 0  # running requests this step samples for the last time
        self.holding = False  # this step's plan kept the queue's head waiting

    def on_add(self, request: Request) -> list[Request] | None:
        self._arrived[request.request_id] = self._clock()
        self._num_arrivals += 1
        return None

    def begin_step(self, step: StepBuilder) -> None:
        self.holding = False
        self._finishing_now = sum(1 for r in step.running if _last_sample_next(r))

    def stops_admission(self, request: Request) -> bool:
        now = self._clock()
        arrived = self._arrived.get(request.request_id, now)
        self.holding = now - arrived < self.max_wait_s and self.arrivals_due(now) > 0
        return self.holding

    def arrivals_due(self, now: float) -> int:
        """Arrivals expected from recent and imminent finishes, not yet come."""
        while self._finishes and self._finishes[0][0] < now - self.max_wait_s:
            self._finishes.popleft()
        came = self._num_arrivals - self._finishes[0][1] if self._finishes else 0
        return len(self._finishes) + self._finishing_now - came

    def on_finish(self, request: Request) -> None:
        self._finishes.append((self._clock(), self._num_arrivals))
        self._arrived.pop(request.request_id, None)

    def on_preempt(self, request: Request, step: StepBuilder | None) -> None:
        self._arrived[request.request_id] = self._clock()  # waiting again: bounded anew

    def on_scheduled(self, request: Request, num_tokens: int, step: StepBuilder) -> None:
        self._arrived.pop(request.request_id, None)  # admitted: no longer waiting


def _last_sample_next(request: Request) -> bool:
    """A decoding request whose next sample reaches its max_tokens."""
    planned_outputs = request.num_planned_tokens - request.num_prompt_tokens
    return planned_outputs >= 1 and planned_outputs + 1 >= request.max_tokens

"""Prefill order: which waiting prompts a step admits first.

Sans-IO: it reads request counters and returns an order; the scheduler allocates
blocks and builds the plan.

- Either order first tries the requests that are part of one already under way
  (`Request.expedite`: a beam search's later beams, which its other beams wait for),
  those that already hold their KV (and so take no blocks) first.
- Order `fcfs` admits the waiting queue as it stands (arrival order, preempted first).
- Order `shortest` admits the fewest remaining prompt tokens first within the step's
  budget: with mixed lengths, short prompts stop queueing behind long ones, which cuts
  mean and median time to first token. Requests resuming (preempted, or whose prefix
  was loaded from elsewhere) keep their place at the head: they have waited already.
  A request passed over in `MAX_BYPASSES` steps goes first, so a stream of short
  prompts cannot starve a long one.

A cap on a step's prefill tokens while others decode was measured too and left out: on
a CPU a 256-token chunk costs ~4 decode steps, so a cap splits bursts into steps that
stall every decoding request (inter-token p99 41 -> 221 ms in the W3 pattern: see
docs/benchmarks.md, "Scheduling for TTFT (CPU)").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.request_queue import RequestQueue

# Steps a waiting request may be passed over by later arrivals under `shortest` before
# it goes first regardless of length (a starvation bound, in steps not seconds: sans-IO).
MAX_BYPASSES = 32
# Waiting requests `shortest` considers per step (so it admits at most this many per
# step): sorting a deep queue every step would cost more than reordering its head saves.
WINDOW = 256


def remaining_prompt_tokens(request: Request) -> int:
    """Prompt tokens (plus outputs to recompute after a preemption) still to compute."""
    return max(request.num_tokens - request.num_computed_tokens, 0)


class PrefillOrder:
    def __init__(self, order: str) -> None:
        if order not in ("fcfs", "shortest"):
            raise ValueError(f"unknown prefill order {order!r}")
        self.order = order
        self._bypasses: dict[str, int] = {}  # req_id -> steps passed over (shortest)
        self._window: list[Request] = []  # the last admission_order's queue head

    # ---- admission order ---------------------------------------------------------

    def admission_order(
        self, waiting: RequestQueue, passed_over: set[str] | None = None
    ) -> Iterator[Request]:
        """The waiting requests a step should try, in the order to try them. Under fcfs
        it is the queue's head, read as the step pops it (no copy of a deep queue); under
        shortest, the head `WINDOW` deep, sorted. `passed_over`: ids the caller skips
        this step (a feature said so), filled while it iterates."""
        if self.order == "fcfs":
            expedited = [r for r in itertools.islice(waiting, WINDOW) if r.expedite]
            expedited.sort(key=lambda r: r.num_computed_tokens == 0)  # KV held: no blocks
            passed = set() if passed_over is None else passed_over
            return itertools.chain(expedited, _queue_head(waiting, passed))
        window = list(itertools.islice(waiting, WINDOW))
        self._window = window
        position = {id(r): index for index, r in enumerate(window)}
        return iter(sorted(window, key=lambda r: self._sort_key(r, position[id(r)])))

    def _sort_key(self, request: Request, position: int) -> tuple[int, int, int]:
        resuming = request.status != RequestStatus.WAITING or request.num_computed_tokens > 0
        starved = self._bypasses.get(request.request_id, 0) >= MAX_BYPASSES
        if request.expedite:  # those holding KV (they take no blocks) first
            return (0, int(request.num_computed_tokens == 0), position)
        if resuming or starved:  # queue order among the ones that go next
            return (1, 0, position)
        return (2, remaining_prompt_tokens(request), position)

    def on_admitted(self, admitted: list[Request]) -> None:
        """After a step's admissions: each request still waiting that is ahead in the
        queue of an admitted one was passed over once more."""
        if self.order == "fcfs" or not admitted:
            return
        admitted_ids = {r.request_id for r in admitted}
        for req_id in admitted_ids:
            self._bypasses.pop(req_id, None)
        window = self._window
        last = max(i for i, r in enumerate(window) if r.request_id in admitted_ids)
        for request in window[:last]:
            if request.request_id not in admitted_ids:
                req_id = request.request_id
                self._bypasses[req_id] = self._bypasses.get(req_id, 0) + 1

    def forget(self, req_id: str) -> None:
        """The request is gone (finished or aborted): drop its count."""
        self._bypasses.pop(req_id, None)


def _queue_head(waiting: RequestQueue, passed_over: set[str]) -> Iterator[Request]:
    """The queue's head each time the caller asks: it pops what it admits, and stops at
    the first it cannot. Once it passes a request over, the rest of the head `WINDOW`
    deep follows in queue order."""
    while len(waiting) > 0:
        head = waiting.peek()
        if head.request_id not in passed_over:
            yield head
            continue
        for request in list(itertools.islice(waiting, WINDOW)):
            if request.request_id not in passed_over:
                yield request
        return

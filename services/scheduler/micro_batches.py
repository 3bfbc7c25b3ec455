"""Pipeline parallelism's scheduling rules: P micro-batches in flight, no request in two.

With P pipeline stages the engine keeps P plans in flight (one per stage), so every
stage has work while the others run theirs. Two rules make that exact and simple:

- A request that has a step in flight is not scheduled again until that step's result
  is back (its chunk, or the token it samples). So whenever a request is scheduled the
  scheduler knows every one of its tokens: no placeholders, and the first stage, which
  never samples, is told the tokens the last stage sampled (`new_token_ids`).
- One step takes at most ceil(running / P) decodes, so that at steady decode the
  running requests spread over P micro-batches of like size instead of one full batch
  followed by P - 1 empty ones. Prefill chunks still fill the token budget.

    running 6, P = 2:   step N  [a b c]   step N+1 [d e f]   step N+2 [a b c] (N back)
"""

from __future__ import annotations

from kvflow.proto.step import CachedRequestData, StepPlan
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import StepBuilder, StepFeature


class MicroBatches:
    """The requests of the plans in flight (sans-IO: the engine core reports returns)."""

    def __init__(self, depth: int) -> None:
        assert depth > 1, depth
        self.depth = depth
        self.in_flight: set[str] = set()

    def busy(self, request: Request) -> bool:
        return request.request_id in self.in_flight

    def decode_cap(self, num_running: int) -> int:
        """Most decodes one step takes: ceil(running / depth), at least 1."""
        return max(1, -(-num_running // self.depth))

    def on_planned(self, req_ids: list[str]) -> None:
        assert self.in_flight.isdisjoint(req_ids), "a request in two micro-batches"
        self.in_flight.update(req_ids)

    def on_returned(self, req_ids: list[str]) -> None:
        self.in_flight.difference_update(req_ids)

    def clear(self) -> None:
        self.in_flight.clear()


def is_decode(request: Request) -> bool:
    """Its prompt is computed: each step it takes the one token it sampled last."""
    return request.num_computed_tokens >= request.num_prompt_tokens


def unsent_token_ids(request: Request, num_forced: int) -> list[int]:
    """The output tokens a step computes from that a stage other than the last may not
    have (only the last stage samples): positions num_computed_tokens.. up to the known
    end, less the grammar-forced tokens that travel in the plan's `forced_token_ids`.
    Prompt positions are never sent: every stage has the prompt."""
    start = request.num_computed_tokens
    if start < request.num_prompt_tokens:
        return []
    return request.all_token_ids[start : request.num_tokens - num_forced]


class MicroBatchFeature(StepFeature):
    """The rules above as a scheduler step feature."""

    def __init__(self, depth: int) -> None:
        self.micro_batches = MicroBatches(depth)
        self._decodes_left = -1  # this step's decode cap, counted down

    def begin_step(self, step: StepBuilder) -> None:
        self._decodes_left = self.micro_batches.decode_cap(len(step.running))

    def holds_back(self, request: Request) -> bool:
        capped = self._decodes_left == 0 and is_decode(request)
        return self.micro_batches.busy(request) or capped

    def on_scheduled_running(
        self, request: Request, cached: CachedRequestData, step: StepBuilder
    ) -> None:
        self._decodes_left -= is_decode(request)
        forced = step.forced_token_ids.get(request.request_id, [])
        cached.new_token_ids = unsent_token_ids(request, len(forced))

    def stops_admission(self, request: Request) -> bool:
        return self.micro_batches.busy(request)  # preempted with a step in flight

    def end_step(self, step: StepBuilder) -> None:
        self.micro_batches.on_planned(list(step.scheduled))

    def on_step_returned(self, plan: StepPlan) -> None:
        self.micro_batches.on_returned(plan.scheduled_req_ids)

    def on_worker_lost(self) -> list[Request]:
        self.micro_batches.clear()  # their steps never return
        return []

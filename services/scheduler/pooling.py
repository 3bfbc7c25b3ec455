"""The pooling runner's requests, as a scheduler step feature.

A pooling request is a prompt and nothing more: admission gives it `max_tokens` 1 and
no room to decode (admission.py), so the step that computes its last prompt token is
its last step, and steps in flight never plan another for it. The worker returns that
step's pooled vector instead of a token (`StepResult.pooled`, empty sampled list); here
the request finishes with "stop" and its delta carries the vector.

Chunked prefill needs nothing more (the worker accumulates a MEAN over the chunks).
Prefix caching: MEAN and CLS need the hidden state of every (or the first) prompt
position, which a cache hit would skip, so those requests never read the cache (their
blocks still fill it); LAST recomputes the last prompt token on every hit anyway
(`KVCacheManager.get_computed_blocks` leaves one to compute), so it takes hits.
"""

from __future__ import annotations

from kvflow.pooling import PoolingSpec
from kvflow.proto.engine import TokenDelta
from kvflow.proto.step import StepResult
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.step_features import ResultEvents, StepFeature


class PoolingFeature(StepFeature):
    def __init__(self, spec: PoolingSpec) -> None:
        self.spec = spec
        self._pooled: dict[str, bytes] = {}  # this result's vectors, until their delta

    def reads_prefix_cache(self, request: Request) -> bool:
        return not self.spec.needs_every_position

    def on_result(self, result: StepResult) -> ResultEvents | None:
        self._pooled = dict(zip(result.req_ids, result.pooled))  # only this result's
        return None

    def on_tokens(self, applied: list[tuple[Request, list[int]]]) -> None:
        for request, _ in applied:
            if request.request_id in self._pooled:
                request.status = RequestStatus.FINISHED_STOPPED

    def on_delta(self, delta: TokenDelta, first: bool) -> None:
        pooled = self._pooled.pop(delta.req_id, None)
        if pooled is not None:
            delta.pooled = pooled

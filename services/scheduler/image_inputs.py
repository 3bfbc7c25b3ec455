"""Images go to the worker with their request: a step feature.

A request travels in full (`NewRequestData`) when it starts and when it resumes after a
preemption; both times it takes the images whose placeholder runs it has still to
compute. Images wholly inside a prefix-cache hit stay behind: their features are never
needed. The worker encodes the rest (or finds them in its encoder cache) the step its
prefill reaches them.
"""

from __future__ import annotations

from kvflow.proto.multimodal import ImageInput
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import StepBuilder, StepFeature


class ImageInputsFeature(StepFeature):
    def __init__(self) -> None:
        self._starting: dict[str, list[ImageInput]] = {}  # this step's new requests

    def on_scheduled(self, request: Request, num_tokens: int, step: StepBuilder) -> None:
        if not request.images:
            return
        # num_computed_tokens already counts this step's tokens.
        computed = request.num_computed_tokens - num_tokens
        pending = [i for i in request.images if i.offset + i.length > computed]
        if pending:
            self._starting[request.request_id] = pending

    def end_step(self, step: StepBuilder) -> None:
        if not self._starting:
            return
        for new in step.new_requests:
            images = self._starting.get(new.req_id)
            if images is not None:
                new.images = images
        self._starting.clear()

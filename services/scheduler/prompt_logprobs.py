"""Prompt logprobs as a scheduler step feature: collected chunk by chunk as the prompt
is computed, sent whole with the request's first token.

Indexed by position, so a chunk recomputed after a preemption overwrites itself. These
requests skip the prefix cache (every position needs its logits).
"""

from __future__ import annotations

from kvflow.proto.engine import TokenDelta
from kvflow.proto.step import StepResult, TokenLogprobs
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import ResultEvents, StepFeature


class PromptLogprobsFeature(StepFeature):
    def __init__(self) -> None:
        self._collected: dict[str, list[TokenLogprobs]] = {}

    def reads_prefix_cache(self, request: Request) -> bool:
        return request.sampling_params.prompt_logprobs is None

    def on_result(self, result: StepResult) -> ResultEvents | None:
        for req_id, chunk in result.prompt_logprobs.items():
            collected = self._collected.setdefault(req_id, [])
            del collected[result.prompt_logprobs_start[req_id] :]
            collected.extend(chunk)
        return None

    def on_delta(self, delta: TokenDelta, first: bool) -> None:
        if first:
            delta.prompt_logprobs = self._collected.pop(delta.req_id, [])

    def on_finish(self, request: Request) -> None:
        self._collected.pop(request.request_id, None)

"""When each request was first scheduled and first sampled: the timestamps its token
deltas carry for the request metrics (queue time, time to first token)."""

from __future__ import annotations

from kvflow.proto.engine import TokenDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.services.scheduler.request import Request


class RequestTimes:
    def __init__(self) -> None:
        self._scheduled: dict[str, float] = {}
        self._first_token: dict[str, float] = {}

    def on_admitted(self, req_id: str, now: float) -> None:
        self._scheduled.setdefault(req_id, now)  # a resumed request keeps its first

    def delta(
        self, request: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs], now: float
    ) -> tuple[TokenDelta, bool]:
        """The request's delta for this step, and whether it is its first."""
        req_id = request.request_id
        first = req_id not in self._first_token
        if first:
            self._first_token[req_id] = now
        delta = TokenDelta(
            req_id=req_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queued_time=request.arrival_time,
            scheduled_time=self._scheduled.get(req_id, now),
            first_token_time=self._first_token[req_id],
        )
        return delta, first

    def forget(self, req_id: str) -> None:
        self._scheduled.pop(req_id, None)
        self._first_token.pop(req_id, None)


def error_delta(request: Request, error: str) -> TokenDelta:
    """The final delta of a request that failed outside a step's sampling."""
    return TokenDelta(
        request.request_id,
        [],
        finish_reason="error",
        num_prompt_tokens=request.num_prompt_tokens,
        error=error,
    )

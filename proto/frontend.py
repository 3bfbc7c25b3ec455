"""Detokenizer -> frontend channel: text deltas routed to the frontend owning a request."""

from __future__ import annotations

import msgspec

from kvflow.proto.step import TokenLogprobs


class RequestOutputDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str  # child id for n > 1 samples ("<id>#<index>")
    text: str  # new text that is safe to stream (stop-string prefixes held back)
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = []
    logprob_tokens: list[list[str]] = []  # decoded strings aligned with logprobs[i].token_ids
    prompt_logprobs: list[TokenLogprobs] = []  # prompt positions 1.., with the first delta
    prompt_logprob_tokens: list[list[str]] = []
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    # Engine timestamps (wall clock, seconds) for request-level metrics.
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    error: str | None = None
    error_code: str | None = None  # TokenDelta.error_code, passed on
    error_param: str | None = None  # the request field at fault: a 400, not a 500
    # Stamped by the frontend as the delta arrives (never sent): the engine whose
    # detokenizer sent it, for the request-level metrics' `engine` label.
    engine_index: int = -1
    pooled: bytes = b""  # the pooling runner's float32 vector (TokenDelta.pooled), passed on
    cumulative_logprob: float | None = None  # TokenDelta.cumulative_logprob, passed on
    # A resumed request's first delta (AddRequest.output_token_ids): the text its output so
    # far stood for, already streamed (a stream resumed from elsewhere absorbs it first).
    resumed_text: str = ""


class FrontendOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    deltas: list[RequestOutputDelta]


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    """A scheduler or worker died: every in-flight request fails, /health turns 503."""

    reason: str


FrontendInput = FrontendOutputs | EngineDead

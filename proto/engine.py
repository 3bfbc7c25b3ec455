"""Frontend -> scheduler and scheduler -> detokenizer channels."""

from __future__ import annotations

import msgspec

from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.proto.sampling import SamplingParams
from kvflow.proto.step import TokenLogprobs

# The prompt tokens the detokenizer reads: the context of a request's first text delta.
# The scheduler forwards only these, not the whole prompt.
DETOKENIZER_PROMPT_TAIL = 12


class AddRequest(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    frontend_id: str = ""  # which frontend owns the request (the detokenizer routes by it)
    # Tokens the request already generated on an engine that died (the frontend re-routed
    # it here): the engine recomputes their KV as after a preemption and samples on from
    # them; the detokenizer takes them as text already streamed.
    output_token_ids: list[int] = []
    # Images whose placeholder runs are in prompt_token_ids (proto/multimodal.py).
    images: list[ImageInput] = []
    lora_request: LoRARequest | None = None  # a LoRA adapter on top of the base model
    mrope: MRopePositions | None = None  # an M-RoPE model's prompt positions (Qwen2.5-VL)


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    req_ids: list[str]
    # "abort" when the client left; "stop" when the detokenizer matched a stop string.
    finish_reason: str = "abort"
    stop_reason: str | None = None


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request from one step (or its end)."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs] = []  # whole prompt, sent once with the first token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit, for usage.prompt_tokens_details
    # Engine-side timestamps (seconds, the scheduler's clock) for request metrics.
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    frontend_id: str = ""
    error: str | None = None
    # Why a request failed, when the frontend answers it with its own status:
    # kvflow.errors.REJECTIONS' codes ("queue_full" -> 429, "queue_timeout" -> 503).
    error_code: str | None = None
    error_param: str | None = None  # set when the request itself was at fault (a 400)
    pooled: bytes = b""  # the pooling runner's vector (StepResult.pooled), with the final delta
    cumulative_logprob: float | None = None  # beam search: the returned beam's logprob sum


class EngineOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    deltas: list[TokenDelta]
    timestamp: float

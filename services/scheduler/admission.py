"""Admission: turn a wire `AddRequest` into a scheduler `Request`, or say why it cannot run.

The frontend validates first (and answers 4xx); this is the engine's own guard, for
limits only the engine knows (KV blocks after profiling) and for frontends that skip a
check. A rejected request gets an error `TokenDelta`, never a crash of the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.errors import InvalidRequestError, PromptTooLongError
from kvflow.model_limits import check_prompt
from kvflow.proto.engine import AddRequest
from kvflow.sampling_params import SamplingParams, validate_sampling_params
from kvflow.services.scheduler.request import Request


@dataclass(frozen=True)
class EngineLimits:
    """What the worker reported after profiling, plus the model's EOS ids."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: frozenset[int]
    enable_lora: bool = False


def check_lengths(prompt_ids: list[int], params: SamplingParams, limits: EngineLimits) -> int:
    """Validate prompt ids and lengths; returns the effective max_tokens."""
    max_tokens = check_prompt(
        prompt_ids, params.max_tokens, limits.max_model_len, limits.vocab_size
    )
    # A request that cannot fit the whole cache alone would be preempted forever.
    needed_blocks = math.ceil((len(prompt_ids) + max_tokens) / limits.block_size)
    if needed_blocks > limits.num_blocks:
        raise PromptTooLongError(
            f"this request needs {needed_blocks} KV blocks but the cache holds "
            f"{limits.num_blocks}; raise kv_cache_memory"
        )
    return max_tokens


def admit(message: AddRequest, limits: EngineLimits, queued_time: float) -> Request:
    """A `Request` for the scheduler core; raises InvalidRequestError with the reason.

    `n > 1` must be fanned out by the frontend into one AddRequest per sample
    (ids "<id>#<index>"): the scheduler, the detokenizer and the wire all see one
    sequence per request id.
    """
    params = message.sampling_params
    validate_sampling_params(params, limits.vocab_size)
    if params.n != 1:
        raise InvalidRequestError(
            f"n={params.n} reached the engine; the frontend sends one request per sample",
            param="n",
        )
    if message.lora_request is not None and not limits.enable_lora:
        raise InvalidRequestError("a LoRA adapter needs an engine started with --enable-lora")
    max_tokens = check_lengths(message.prompt_token_ids, params, limits)
    return Request(
        message.req_id,
        message.prompt_token_ids,
        params,
        eos_token_ids=limits.eos_token_ids,
        arrival_time=queued_time,
        priority=message.priority,
        cache_salt=message.cache_salt,
        max_tokens=max_tokens,
        lora_request=message.lora_request,
    )

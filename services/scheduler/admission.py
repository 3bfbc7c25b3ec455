"""Admission: turn a wire `AddRequest` into a scheduler `Request`, or say why it cannot run.

The frontend validates first (and answers 4xx); this is the engine's own guard, for
limits only the engine knows (KV blocks after profiling) and for frontends that skip a
check. A rejected request gets an error `TokenDelta`, never a crash of the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.errors import InvalidRequestError, PromptTooLongError
from kvflow.proto.engine import AddRequest
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.request import Request


@dataclass(frozen=True)
class EngineLimits:
    """What the worker reported after profiling, plus the model's EOS ids."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: frozenset[int]


def check_lengths(prompt_ids: list[int], params: SamplingParams, limits: EngineLimits) -> int:
    """Validate prompt ids and lengths; returns the effective max_tokens."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    for token_id in prompt_ids:
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequestError(f"prompt token id {token_id} is out of vocabulary")
    room = limits.max_model_len - len(prompt_ids)
    if room < 1:
        raise PromptTooLongError(
            f"prompt has {len(prompt_ids)} tokens; this model's context is "
            f"{limits.max_model_len} tokens",
            param="prompt",
        )
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise PromptTooLongError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length {limits.max_model_len}",
            param="max_tokens",
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
    params.validate(limits.vocab_size)
    if params.n != 1:
        raise InvalidRequestError(
            f"n={params.n} reached the engine; the frontend sends one request per sample",
            param="n",
        )
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
    )

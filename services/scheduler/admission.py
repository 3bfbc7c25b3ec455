"""Admission: turn a wire `AddRequest` into a scheduler `Request`, or say why it cannot run.

The frontend validates first (and answers 4xx); this is the engine's own guard, for
limits only the engine knows (KV blocks after profiling) and for frontends that skip a
check. A rejected request gets an error `TokenDelta`, never a crash of the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.errors import InvalidRequestError, PromptTooLongError
from kvflow.kv_groups import max_blocks_held
from kvflow.model_limits import check_pooling_prompt, check_prompt
from kvflow.proto.engine import AddRequest
from kvflow.proto.multimodal import MAX_IMAGE_BYTES, ImageInput
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
    pooling: bool = False  # the pooling runner: prompts only (scheduler/pooling.py)
    # Hybrid KV cache: the groups' windows (kvflow/kv_groups.py) and the most tokens a
    # request computes in one step (0: unbounded), which bound a sliding group's blocks.
    kv_group_windows: tuple[int | None, ...] = (None,)
    max_chunk_tokens: int = 0
    enable_lora: bool = False


def check_lengths(prompt_ids: list[int], params: SamplingParams, limits: EngineLimits) -> int:
    """Validate prompt ids and lengths; returns the effective max_tokens (1 for a
    pooling request: its one "sample" is the pooled vector, and it takes no KV slot)."""
    if limits.pooling:
        check_pooling_prompt(prompt_ids, limits.max_model_len, limits.vocab_size)
        max_tokens, num_slots = 1, len(prompt_ids)
    else:
        max_tokens = check_prompt(
            prompt_ids, params.max_tokens, limits.max_model_len, limits.vocab_size
        )
        num_slots = len(prompt_ids) + max_tokens
    # A request that cannot fit the whole cache alone would be preempted forever.
    needed_blocks = max_blocks_held(
        limits.kv_group_windows, num_slots, limits.block_size, limits.max_chunk_tokens
    )
    if needed_blocks > limits.num_blocks:
        raise PromptTooLongError(
            f"this request needs {needed_blocks} KV blocks but the cache holds "
            f"{limits.num_blocks}; raise kv_cache_memory"
        )
    return max_tokens


_PIXEL_BYTES = {"float32": 4, "float16": 2}


def check_image_spans(message: AddRequest) -> list[ImageInput]:
    """The request's images, whose placeholder runs must lie in the prompt, in order
    and apart (the worker and the block hashes rely on it)."""
    end = 0
    for image in message.images:
        if image.length < 1 or image.offset < end:
            raise InvalidRequestError("image placeholder runs overlap or are out of order")
        end = image.offset + image.length
        pixels = image.pixels
        size = math.prod(pixels.shape) * _PIXEL_BYTES.get(pixels.dtype, 0)
        if size != len(pixels.data) or size == 0 or size > MAX_IMAGE_BYTES:
            # Refused here, not by the worker, where it would fail the whole step.
            raise InvalidRequestError(
                f"image pixels {pixels.dtype}{pixels.shape} in {len(pixels.data)} bytes "
                f"(float32/float16 only, at most {MAX_IMAGE_BYTES} bytes)"
            )
    if end > len(message.prompt_token_ids):
        raise InvalidRequestError("an image's placeholder run ends past the prompt")
    mrope = message.mrope
    if mrope is not None and len(mrope.data) != 3 * 4 * len(message.prompt_token_ids):
        raise InvalidRequestError("M-RoPE positions do not match the prompt's length")
    return message.images


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
    if len(message.output_token_ids) >= max_tokens:
        raise InvalidRequestError(
            f"a resumed request brings {len(message.output_token_ids)} output tokens but "
            f"may have only {max_tokens}"
        )
    request = Request(
        message.req_id,
        message.prompt_token_ids,
        params,
        eos_token_ids=limits.eos_token_ids,
        arrival_time=queued_time,
        priority=message.priority,
        cache_salt=message.cache_salt,
        max_tokens=max_tokens,
        images=check_image_spans(message),
        lora_request=message.lora_request,
        mrope=message.mrope,
    )
    request.all_token_ids += message.output_token_ids  # recomputed, as after a preemption
    return request

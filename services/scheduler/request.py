"""The scheduler's view of one generation request.

Glossary (vLLM's vocabulary)::

    all_token_ids   = prompt_token_ids + output_token_ids
                      |<--- num_prompt_tokens --->|<-- num_output_tokens -->|
    KV in the cache   |<------- num_computed_tokens ------->|
    still to compute                                        |<- num_tokens - num_computed ->|

    num_tokens = len(all_token_ids)

With steps in flight (async scheduling), a step that will sample for a request is
planned before the token it samples is known: `num_output_placeholders` counts those
tokens, and the next step may already compute at their positions (the worker fills
in what it sampled). Each sampled token that comes back replaces one placeholder.

A request is *sampled* in a step when the tokens scheduled for it reach `num_tokens`
(the end of what is known): a prefill chunk that stops short samples nothing. A
preempted request drops its KV (`num_computed_tokens = 0`) and later recomputes prompt
*and* outputs, so resuming is just another prefill.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.proto.step import NewRequestData
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.services.scheduler.grammar_matcher import RequestGrammar

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING_FOR_BEAMS = -2  # a beam search's result, until the search ends (beam_feature.py)
    WAITING_FOR_REMOTE_KV = -1  # P/D: its prompt KV is on its way (kv_transfer/remote_loads.py)
    WAITING_FOR_GRAMMAR = 0  # guided: its grammar compiles in the pool (engine_core.py)
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS, a stop token id, a stop string or a completed grammar
    FINISHED_LENGTH = 5  # max_tokens or the model's context length
    FINISHED_ABORTED = 6  # client went away or asked to cancel
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def is_parked(self) -> bool:
        """Held by a step feature, in neither the waiting queue nor the running list."""
        return self in (RequestStatus.WAITING_FOR_BEAMS, RequestStatus.WAITING_FOR_REMOTE_KV)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int,
        images: list[ImageInput] | None = None,
        lora_request: LoRARequest | None = None,
        mrope: MRopePositions | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.priority = priority  # lower value = served first (vLLM's convention)
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # a LoRA adapter on top of the base model
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what fits the context
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # planned samples whose token is not back yet
        # Draft tokens of the verification step in flight (None: none in flight); its
        # num_computed_tokens already counts them, and the result rolls back the rejected.
        self.num_spec_in_flight: int | None = None
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.grammar: RequestGrammar | None = None  # guided decoding: set once compiled
        # Images of the prompt (sent to the worker with the request) and their
        # placeholder runs, which the prefix cache's block hashes cover.
        self.images: list[ImageInput] = images or []
        self.image_spans = [(i.offset, i.length, i.hash) for i in self.images]
        self.mrope = mrope  # an M-RoPE model's prompt positions, for the worker
        # Part of a request already under way (a beam search's later beams): admitted
        # before the queue's other requests (prefill_order.py), which it does not outrun.
        self.expedite = False

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model): a key of the prefix cache."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus the ones steps in flight will sample."""
        return len(self.all_token_ids) + self.num_output_placeholders

    def may_sample_more(self, max_model_len: int) -> bool:
        """Whether one more sample can be planned: the in-flight ones may already reach
        max_tokens or the context (an EOS cannot be foreseen and costs one token)."""
        planned = self.num_planned_tokens
        return planned - self.num_prompt_tokens < self.max_tokens and planned < max_model_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_output_placeholders = max(self.num_output_placeholders - 1, 0)

    def append_sampled(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """Append a step's sampled tokens up to the first that stops the request;
        returns the appended ones."""
        appended = []
        for token_id in token_ids:
            self.append_output_token(token_id)
            appended.append(token_id)
            if not self._grammar_accepts(token_id) or self.check_stop(max_model_len):
                break
        return appended

    def _grammar_accepts(self, token_id: int) -> bool:
        """Advance a guided request's matcher; a token outside its grammar (the mask
        makes that impossible unless something else forced every token out) fails it."""
        if self.grammar is None or self.grammar.accept(token_id):
            return True
        logger.error("request %s sampled token %d outside its grammar", self.request_id, token_id)
        self.status = RequestStatus.FINISHED_ERROR
        return False

    def new_request_data(
        self, block_ids: list[int], group_block_ids: list[list[int]]
    ) -> NewRequestData:
        """What the worker learns of this request when it (re)starts: its tokens (outputs
        too, when resuming), its sampling, its adapter and its KV blocks per group."""
        return NewRequestData(
            req_id=self.request_id,
            token_ids=list(self.all_token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            sampling_params=self.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=self.num_computed_tokens,
            group_block_ids=group_block_ids,
            lora_request=self.lora_request,
            mrope=self.mrope,
        )

    def reset_for_recompute(self) -> None:
        """Back to waiting without KV: prompt and outputs are computed again (the
        samples and drafts of steps in flight are dropped with their KV)."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_spec_in_flight = None

    def check_stop(self, max_model_len: int) -> bool:
        """After appending a token: set a finished status if a stop condition holds."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED  # the grammar took its stop token
            return True
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def sort_key(self) -> tuple[int, float]:
        """Order in the priority policy: priority first, then arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

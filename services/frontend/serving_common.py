"""What completions and chat share: prompt preparation, length checks, and running the
prompts of one HTTP request on the engine as one stream of (choice index, delta).

Choice indices follow OpenAI: prompt p's sample i is choice `p * n + i`.

Streaming rule (the chunk-per-token rule), as vLLM streams: every delta that brings
tokens is a chunk, its text empty while the detokenizer holds back an incomplete
character or a possible stop string. A client thus sees each token arrive when it does
(and a benchmark's inter-token latency is per token, not per visible character). With
a tool-call or reasoning parser, a chat chunk carries only what the parser lets out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from abc import ABC, abstractmethod
from asyncio import wait_for
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvflow.errors import (
    REJECTIONS,
    EngineDeadError,
    InvalidRequestError,
    KvflowError,
    RequestRejectedError,
    RequestTimeoutError,
)
from kvflow.model_limits import check_prompt
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.proto.step import TokenLogprobs
from kvflow.sampling_params import (
    SamplingParams,
    truncate_prompt,
    validate_sampling_params,
    with_bad_words_token_ids,
)
from kvflow.services.frontend.choice_counts import ChoiceCounts
from kvflow.services.frontend.config import FrontendConfig
from kvflow.services.frontend.errors import CLIENT_CLOSED_REQUEST
from kvflow.services.frontend.in_flight import sample_index
from kvflow.services.frontend.kv_params import KVParamsGate, KVResume, ResumedChoice
from kvflow.services.frontend.lora_registry import LoRARegistry
from kvflow.services.frontend.metrics import FrontendMetrics
from kvflow.services.frontend.request_deadline import Deadline, RequestDeadlines
from kvflow.services.frontend.responses import UsageInfo
from kvflow.services.frontend.resumed_stream import resumed_choices, samples_of
from kvflow.services.frontend.serving_engine import ServingEngine
from kvflow.services.frontend.sse import SSEResponse, unless_disconnected, until_disconnect
from kvflow.services.frontend.stream_merge import merge_streams
from kvflow.token_strings import convert_ids_to_token_strings
from kvflow.tokenizer import Conversation, apply_chat_template

# JSON has no -inf; OpenAI clients expect a number (vLLM uses the same floor).
MIN_LOGPROB = -9999.0

T = TypeVar("T")


class RequestFailedError(KvflowError):
    """The engine failed a request after it started (HTTP 500 / an SSE error event)."""


def engine_error(delta: RequestOutputDelta) -> KvflowError:
    """The exception an engine "error" delta stands for: the request's own fault (400,
    e.g. a grammar compile timeout), a load refusal by its code (429/503), else a
    failure (500)."""
    message = delta.error or "the engine failed the request"
    if delta.error_param is not None:
        return InvalidRequestError(message, param=delta.error_param)
    rejection = REJECTIONS.get(delta.error_code or "")
    return rejection(message) if rejection is not None else RequestFailedError(message)


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt as text (given or decoded), for echo
    params: SamplingParams  # validated, with max_tokens resolved for this prompt's length
    images: list[ImageInput] = field(default_factory=list)  # placeholder runs in token_ids
    mrope: MRopePositions | None = None  # an M-RoPE model's positions of token_ids


@dataclass
class ServingContext:
    config: FrontendConfig
    engine: ServingEngine
    tokenizer: Any
    metrics: FrontendMetrics
    kv_params: KVParamsGate  # only the proxy's kv_transfer_params pass
    lora: LoRARegistry = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.lora = LoRARegistry(config.lora, config.model_dir, config.served_model_name)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base); 404 when nothing is served
        under that name."""
        return self.lora.resolve(model)

    def check_engine(self, data_parallel_rank: int | None = None) -> None:
        problem = self.engine.health_problem()
        if problem is not None:
            raise EngineDeadError(problem)
        self.engine.check_rank(data_parallel_rank)

    def check_queue_room(self, num_prompts: int, n: int, data_parallel_rank: int | None) -> None:
        """400 for a request the engines could never admit: each sample waits as one
        request, and an engine refuses one past --max-waiting-requests even when idle
        (its 429 would say retry, forever). A prompt's samples share one engine; the
        prompts of a list may spread over the engines unless a rank pins them."""
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        if n > limit:
            raise InvalidRequestError(
                f"n={n} exceeds the server's max waiting requests ({limit}): each sample "
                "waits as one request, so this request could never be admitted",
                param="n",
            )
        engines = 1 if data_parallel_rank is not None else self.engine.engine_count
        if num_prompts * n > limit * engines:
            raise InvalidRequestError(
                f"{num_prompts} prompts x n={n} samples exceed the server's max waiting "
                f"requests ({limit * engines}): this request could never be admitted; "
                "send fewer prompts per request",
                param="prompt",
            )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        try:
            return apply_chat_template(
                self.tokenizer, conversation, add_generation_prompt, tools, template_kwargs
            )
        except jinja2.TemplateError as exc:
            # Templates reject conversations with raise_exception (e.g. roles out of order).
            raise InvalidRequestError(f"chat template: {exc}", param="messages") from None

    def prepare(
        self, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True
    ) -> PreparedPrompt:
        if isinstance(prompt, str):
            return self.prepare_ids(self.encode(prompt, add_special_tokens), params, prompt)
        return self.prepare_ids(prompt, params, None)

    def prepare_ids(
        self, token_ids: list[int], params: SamplingParams, text: str | None
    ) -> PreparedPrompt:
        """Check the ids and the lengths; validate params with max_tokens resolved
        (after truncate_prompt_tokens, and with the bad words' token ids)."""
        vocab_size = self.config.vocab_size
        token_ids = truncate_prompt(token_ids, params, self.config.max_model_len)
        max_tokens = check_prompt(
            token_ids, params.max_tokens, self.config.max_model_len, vocab_size
        )
        resolved = msgspec.structs.replace(params, max_tokens=max_tokens)
        resolved = with_bad_words_token_ids(resolved, self.tokenizer)
        validate_sampling_params(resolved, vocab_size)
        return PreparedPrompt(token_ids, text, resolved)

    def prompt_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return str(self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False))

    def token_strings(self, entry: TokenLogprobs, strings: list[str] | None) -> list[str]:
        """Strings of entry.token_ids: the detokenizer's, else decoded here."""
        if strings is not None and len(strings) == len(entry.token_ids):
            return strings
        return convert_ids_to_token_strings(self.tokenizer, entry.token_ids)

    async def generate(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        *,
        priority: int,
        cache_salt: str | None,
        arrival_time: float,
        data_parallel_rank: int | None = None,
        deadline: Deadline | None = None,
        lora_request: LoRARequest | None = None,
        resume: dict[int, ResumedChoice] | None = None,  # choice -> a resumed one's
    ) -> AsyncGenerator[tuple[int, RequestOutputDelta], None]:
        """(choice index, delta) for every sample of every prompt, as they come.

        Raises RequestFailedError on an engine error, a RequestRejectedError when the
        engine refused it for load, RequestTimeoutError past `deadline`; closing this
        generator (or a cancelled consumer) aborts every unfinished sample. Feeds
        request metrics."""
        n = prompts[0].params.n
        streams = [
            self.engine.generate(
                f"{request_id}-{i}",
                p.token_ids,
                p.params,
                priority,
                cache_salt,
                arrival_time,
                data_parallel_rank,
                deadline,
                images=p.images,
                lora_request=lora_request,
                mrope=p.mrope,
                resume=samples_of(resume, i, n),
            )
            for i, p in enumerate(prompts)
        ]
        trackers = [self.metrics.track_request(arrival_time) for _ in range(len(prompts) * n)]
        failed = False
        self.lora.acquire(lora_request)  # an adapter in use cannot be unloaded
        self.metrics.count_lora_request(lora_request)
        try:
            async with aclosing(merge_streams(streams)) as merged:
                async for prompt_index, delta in merged:
                    choice = prompt_index * n + sample_index(delta.req_id)
                    engine = self.engine.engine_label(delta)
                    trackers[choice].observe(delta, time.time(), engine)
                    if delta.finish_reason == "error":
                        failed = True
                        raise engine_error(delta)
                    yield choice, delta
        except (RequestRejectedError, RequestTimeoutError) as exc:
            self.metrics.count_rejected(exc.code)
            raise
        finally:
            self.lora.release(lora_request)
            if not failed:  # the client left: unfinished samples count as aborted
                now = time.time()
                for tracker in trackers:
                    tracker.abandon(now)


def _without_prompt_logprobs(prompt: PreparedPrompt) -> PreparedPrompt:
    params = msgspec.structs.replace(prompt.params, prompt_logprobs=None)
    return dataclasses.replace(prompt, params=params)


_JSON = msgspec.json.Encoder()


def json_response(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(_JSON.encode(payload), status_code=status, media_type="application/json")


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


class ServedRequest(ABC):
    """What a validated completions or chat request has: its id, prompts, the merged
    engine stream of its choices, and usage (each prompt counts once, however large n;
    cached tokens are each prompt's sample 0's).

    `respond` waits for the engine's first delta before a stream's status line goes
    out, so that a refusal (queue full: 429, queue timeout: 503, its own timeout: 408)
    is the response's status, not an error event inside a 200 stream."""

    def __init__(
        self,
        ctx: ServingContext,
        id_prefix: str,
        prompts: list[PreparedPrompt],
        *,
        priority: int,
        cache_salt: str | None,
        arrival_time: float,
        deadlines: RequestDeadlines,
        data_parallel_rank: int | None = None,
        model: str | None = None,
        resume: KVResume | None = None,
    ) -> None:
        ctx.check_queue_room(len(prompts), prompts[0].params.n, data_parallel_rank)
        ctx.kv_params.check(prompts[0].params.kv_transfer_params)
        # A stream the proxy resumes (kv_params.py): choice index -> what its client has.
        resumed = ctx.kv_params.check_resume(resume)
        self.resumed = resumed_choices(resumed, len(prompts), prompts[0].params)
        if self.resumed is not None:  # prompt logprobs went out with the first stream
            prompts = [_without_prompt_logprobs(p) for p in prompts]
        self.ctx = ctx
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(arrival_time)
        self.lora_request = ctx.check_model(model)  # the response names the adapter
        lora = self.lora_request
        self.model = ctx.config.served_model_name if lora is None else lora.lora_name
        self.prompts = prompts
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.data_parallel_rank = data_parallel_rank
        self.deadlines = deadlines
        self._deltas: AsyncGenerator[tuple[int, RequestOutputDelta], None] | None = None
        self._first: tuple[int, RequestOutputDelta] | None = None

    async def respond(self, raw: Request, stream: bool) -> Response:
        if self.resumed is not None and not stream:
            raise InvalidRequestError("kv_resume resumes a stream only", param="kv_resume")
        if not stream:
            return await until_disconnect(raw, self.full())
        if await unless_disconnected(raw.receive, self._open()) is None:
            await self.close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return SSEResponse(self.stream())

    @abstractmethod
    async def full(self) -> Response:
        """The whole response, once every choice finished."""

    @abstractmethod
    def stream(self) -> AsyncGenerator[bytes, None]:
        """The SSE events of the response."""

    async def _open(self) -> bool:
        """Send the request to the engine and wait for its first delta."""
        self._deltas = self.ctx.generate(
            self.id,
            self.prompts,
            priority=self.priority,
            cache_salt=self.cache_salt,
            arrival_time=self.arrival_time,
            data_parallel_rank=self.data_parallel_rank,
            deadline=self.deadlines.whole,
            lora_request=self.lora_request,
            resume=self.resumed,
        )
        first: Awaitable[tuple[int, RequestOutputDelta]] = anext(self._deltas)
        limit = self.deadlines.first_chunk
        try:
            self._first = await (first if limit is None else wait_for(first, limit.remaining()))
        except StopAsyncIteration:
            self._first = None
        except asyncio.TimeoutError:
            self.ctx.metrics.count_rejected(RequestTimeoutError.code)
            assert limit is not None
            raise limit.error() from None
        return True

    async def close(self) -> None:
        if self._deltas is not None:
            await self._deltas.aclose()

    async def deltas(self) -> AsyncGenerator[tuple[int, RequestOutputDelta], None]:
        """(choice index, delta) of every choice, the first one included."""
        if self._deltas is None:
            await self._open()
        assert self._deltas is not None
        async with aclosing(self._deltas) as rest:
            if self._first is not None:
                yield self._first
            async for item in rest:
                yield item

    def resume_choices(self, choices: Sequence[ChoiceCounts]) -> None:
        """Each resumed choice takes what its client has (usage counts it)."""
        for index, resumed in (self.resumed or {}).items():
            choices[index].resume(resumed.token_ids, resumed.finished)

    def ids_if(self, wanted: bool, ids: list[int]) -> list[int] | msgspec.UnsetType:
        """`ids` for return_token_ids, else absent from the response."""
        return ids if wanted else msgspec.UNSET

    def usage(self, choices: Sequence[ChoiceCounts]) -> UsageInfo:
        n = len(choices) // len(self.prompts)
        return UsageInfo.of(
            prompt_tokens=sum(len(p.token_ids) for p in self.prompts),
            completion_tokens=sum(c.num_tokens for c in choices),
            cached_tokens=sum(choices[p * n].num_cached_tokens for p in range(len(self.prompts))),
        )

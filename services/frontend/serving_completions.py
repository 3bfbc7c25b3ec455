"""POST /v1/completions: one or more prompts, n samples each, streamed or not.

Logprobs use OpenAI's completions shape, parallel lists over the choice's tokens:
    tokens[i]          the token's text ("bytes:\\xe4" for a partial UTF-8 character)
    token_logprobs[i]  its logprob (None for the first prompt token when echoing)
    top_logprobs[i]    {token text: logprob} of the sampled token and the top-N
    text_offset[i]     where the token starts in the choice's returned text
With `echo`, the prompt's text comes first, and with logprobs its tokens too (scored by
the engine's prompt logprobs).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import Response

from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.services.frontend.choice_counts import ChoiceCounts
from kvflow.services.frontend.ignored_fields import ignored_fields, mark_ignored
from kvflow.services.frontend.protocol import CompletionRequest, decode_request
from kvflow.services.frontend.request_deadline import RequestDeadlines, request_deadlines
from kvflow.services.frontend.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
)
from kvflow.services.frontend.runner_routes import check_generating
from kvflow.services.frontend.serving_common import (
    PreparedPrompt,
    ServedRequest,
    ServingContext,
    clamp_logprob,
    json_response,
)
from kvflow.services.frontend.sse import sse_event
from kvflow.token_strings import convert_ids_to_token_strings


class _Choice(ChoiceCounts):
    """One choice being assembled from its deltas."""

    def __init__(self, index: int, prompt: PreparedPrompt, echo: str | None, logprobs: bool):
        super().__init__()
        self.index = index
        self.prompt = prompt
        self.echo = echo
        self.want_logprobs = logprobs
        self.text: list[str] = []
        self.logprobs = CompletionLogprobs() if logprobs else None
        self.offset = 0  # characters of text before the next token
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.started = False

    def apply(self, ctx: ServingContext, delta: RequestOutputDelta) -> CompletionChoice:
        """Fold in one delta; returns this delta's part of the choice (a stream chunk)."""
        resumed = self.take_resumed_text(delta)
        if resumed is not None:
            self._absorb(ctx, resumed)
        text = delta.text
        part = CompletionLogprobs() if self.want_logprobs else None
        if not self.started:
            self.started = True
            if self.echo is not None:
                text = self.echo + text
                if part is not None:
                    self._add_prompt(ctx, part, delta)
        if part is not None:
            for i, entry in enumerate(delta.logprobs):
                self._add_entry(ctx, part, entry, _at(delta.logprob_tokens, i))
            _extend(self.logprobs, part)
        self.text.append(text)
        self.count(delta)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return CompletionChoice(
            index=self.index,
            text=text,
            logprobs=part,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )

    def _absorb(self, ctx: ServingContext, text: str) -> None:
        """A resumed stream's text so far (its tokens are counted): the client has it,
        echo included; logprobs' text offsets go on after it."""
        self.started = True
        self.text.append((self.echo or "") + text)
        if self.want_logprobs:
            shown = (self.prompt.token_ids if self.echo is not None else []) + self.token_ids
            self.offset += sum(map(len, convert_ids_to_token_strings(ctx.tokenizer, shown)))

    def _add_prompt(
        self, ctx: ServingContext, part: CompletionLogprobs, delta: RequestOutputDelta
    ) -> None:
        """Echoed prompt tokens: position 0 has no logprob; 1.. come from the engine."""
        token_ids = self.prompt.token_ids
        for pos, token in enumerate(convert_ids_to_token_strings(ctx.tokenizer, token_ids)):
            index = pos - 1
            if 0 <= index < len(delta.prompt_logprobs):
                strings = _at(delta.prompt_logprob_tokens, index)
                self._add_entry(ctx, part, delta.prompt_logprobs[index], strings)
            else:
                self._add(part, token, None, None)

    def _add_entry(
        self,
        ctx: ServingContext,
        part: CompletionLogprobs,
        entry: TokenLogprobs,
        strings: list[str] | None,
    ) -> None:
        texts = ctx.token_strings(entry, strings)
        top = {texts[j]: clamp_logprob(lp) for j, lp in enumerate(entry.logprobs)}
        self._add(part, texts[0], clamp_logprob(entry.logprobs[0]), top)

    def _add(
        self,
        part: CompletionLogprobs,
        token: str,
        logprob: float | None,
        top: dict[str, float] | None,
    ) -> None:
        part.tokens.append(token)
        part.token_logprobs.append(logprob)
        part.top_logprobs.append(top)
        part.text_offset.append(self.offset)
        self.offset += len(token)

    def final(self) -> CompletionChoice:
        return CompletionChoice(
            index=self.index,
            text="".join(self.text),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def _at(strings: list[list[str]], index: int) -> list[str] | None:
    return strings[index] if index < len(strings) else None


def _extend(total: CompletionLogprobs | None, part: CompletionLogprobs) -> None:
    assert total is not None
    total.tokens += part.tokens
    total.token_logprobs += part.token_logprobs
    total.top_logprobs += part.top_logprobs
    total.text_offset += part.text_offset


class _Completion(ServedRequest):
    """One /v1/completions request after validation."""

    def __init__(
        self,
        ctx: ServingContext,
        request: CompletionRequest,
        deadlines: RequestDeadlines,
    ) -> None:
        params = request.to_sampling_params()  # validated in ctx.prepare, once per prompt
        prompts = [
            ctx.prepare(prompt, params, request.add_special_tokens) for prompt in request.prompts()
        ]
        super().__init__(
            ctx,
            "cmpl",
            prompts,
            priority=request.priority,
            cache_salt=request.cache_salt,
            model=request.model,
            data_parallel_rank=request.data_parallel_rank,
            arrival_time=time.time(),
            deadlines=deadlines,
            resume=request.kv_resume,
        )
        self.include_usage = request.include_usage
        self.return_ids = bool(request.return_token_ids)
        want_logprobs = request.logprobs is not None
        self.choices = [
            _Choice(
                p * params.n + i,
                prompt,
                ctx.prompt_text(prompt) if request.echo else None,
                want_logprobs,
            )
            for p, prompt in enumerate(prompts)
            for i in range(params.n)
        ]
        self.resume_choices(self.choices)

    async def full(self) -> Response:
        async with aclosing(self.deltas()) as deltas:
            async for index, delta in deltas:
                self.choices[index].apply(self.ctx, delta)
        choices = [c.final() for c in self.choices]
        for choice, counts in zip(choices, self.choices):
            choice.prompt_token_ids = self.ids_if(self.return_ids, counts.prompt.token_ids)
            choice.token_ids = self.ids_if(self.return_ids, counts.token_ids)
        response = CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(self.choices),
        )
        return json_response(response)

    async def stream(self) -> AsyncGenerator[bytes, None]:
        async with aclosing(self.deltas()) as deltas:
            async for index, delta in deltas:
                choice = self.choices[index].apply(self.ctx, delta)
                choice.token_ids = self.ids_if(self.return_ids, delta.token_ids)
                has_logprobs = choice.logprobs is not None and bool(choice.logprobs.tokens)
                if (
                    choice.text
                    or delta.token_ids  # serving_common.py's chunk-per-token rule
                    or has_logprobs
                    or choice.finish_reason is not None
                ):
                    yield sse_event(self._chunk([choice]))
        if self.include_usage:
            yield sse_event(self._chunk([], usage=True))

    def _chunk(self, choices: list[CompletionChoice], usage: bool = False) -> CompletionChunk:
        return CompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(self.choices) if usage else None,
        )


def prepare_completion(
    ctx: ServingContext, body: bytes, headers: Mapping[str, str]
) -> tuple[ServedRequest, bool]:
    """A validated /v1/completions body, ready to run, and whether it streams (call on
    the event loop); raises what becomes the error response. `kvflow run-batch` too."""
    check_generating(ctx)
    request = decode_request(body, CompletionRequest)
    ctx.check_model(request.model)
    deadlines = request_deadlines(request.timeout, headers, bool(request.stream))
    completion = _Completion(ctx, request, deadlines)
    ctx.check_engine(request.data_parallel_rank)
    return completion, bool(request.stream)


async def create_completion(ctx: ServingContext, raw: Request, body: bytes) -> Response:
    completion, stream = prepare_completion(ctx, body, raw.headers)
    ignored = ignored_fields(body, CompletionRequest)
    return mark_ignored(await completion.respond(raw, stream), ignored)

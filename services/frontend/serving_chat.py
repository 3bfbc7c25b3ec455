"""POST /v1/chat/completions: the conversation rendered with the model's chat template.

Streams start with one chunk per choice carrying `role: assistant` (and the echoed
text, if any), then content deltas; the chunk that ends a choice has its finish_reason.
Logprobs use the chat shape: content = [{token, logprob, bytes, top_logprobs: [...]}].
With `--reasoning-parser`, the thinking goes to `reasoning_content` (streamed as
`delta.reasoning_content` before the content; reasoning.py) and tool calls are read from
the content after it. `echo` (vLLM's extra) prepends the last message's content when it is the role being
generated, i.e. an assistant turn the model continues.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.services.frontend.chat_images import chat_images, prepare_chat_prompt
from kvflow.services.frontend.choice_counts import ChoiceCounts
from kvflow.services.frontend.ignored_fields import ignored_fields, mark_ignored
from kvflow.services.frontend.protocol import ChatCompletionRequest, decode_request
from kvflow.services.frontend.reasoning import (
    ReasoningParser,
    gate_after_reasoning,
    reasoning_parser,
)
from kvflow.services.frontend.request_deadline import RequestDeadlines, request_deadlines
from kvflow.services.frontend.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
)
from kvflow.services.frontend.runner_routes import check_generating
from kvflow.services.frontend.serving_common import (
    ServedRequest,
    ServingContext,
    clamp_logprob,
    json_response,
)
from kvflow.services.frontend.sse import sse_event
from kvflow.services.frontend.tool_calling import ToolUse, tool_use, with_tools
from kvflow.services.frontend.tool_parser import (
    ToolCallStream,
    extract_tool_calls,
    finish_reason_of,
)

_ASSISTANT = "assistant"


def token_bytes(token: str) -> list[int]:
    """UTF-8 bytes of a logprob token string; "bytes:\\xe4" spells raw bytes itself."""
    if not token.startswith("bytes:"):
        return list(token.encode("utf-8"))
    spelled, out, i = token[len("bytes:") :], [], 0
    while i < len(spelled):
        if spelled.startswith("\\x", i) and i + 4 <= len(spelled):
            out.append(int(spelled[i + 2 : i + 4], 16))
            i += 4
        else:
            out.extend(spelled[i].encode("utf-8"))
            i += 1
    return out


class _Choice(ChoiceCounts):
    def __init__(
        self, index: int, logprobs: bool, tools: ToolUse, reasoning: ReasoningParser | None
    ) -> None:
        super().__init__()
        self.reasoning = reasoning
        self.reasoning_stream = reasoning.stream() if reasoning is not None else None
        self.index = index
        self.want_logprobs = logprobs
        self.text: list[str] = []
        self.logprobs: list[ChatTokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.tools = tools
        self.tool_stream = ToolCallStream(tools) if tools.mode != "none" else None
        self.num_streamed_calls = 0
        # serving_common.py's chunk-per-token rule; a parser's chunks carry only what
        # it lets out.
        self.chunk_per_token = self.tool_stream is None and self.reasoning_stream is None

    def apply(self, ctx: ServingContext, delta: RequestOutputDelta) -> ChatChunkChoice:
        """Fold in one delta; returns this delta's part of the choice (a stream chunk)."""
        resumed = self.take_resumed_text(delta)
        if resumed:  # the old stream's text: through the parsers, not to the client again
            self.text.append(resumed)
            self._delta_message(RequestOutputDelta(delta.req_id, resumed, []))
        part: list[ChatTokenLogprob] = []
        if self.want_logprobs:
            for i, entry in enumerate(delta.logprobs):
                strings = delta.logprob_tokens[i] if i < len(delta.logprob_tokens) else None
                part.append(_token_logprob(ctx, entry, strings))
            self.logprobs += part
        self.text.append(delta.text)
        self.count(delta)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        message = self._delta_message(delta)
        return ChatChunkChoice(
            index=self.index,
            delta=message,
            logprobs=ChatLogprobs(content=part) if part else None,
            finish_reason=self._finish_reason(self.num_streamed_calls),
            stop_reason=delta.stop_reason,
        )

    def _delta_message(self, delta: RequestOutputDelta) -> DeltaMessage:
        """Text as content, or (tool calling) content and tool_calls pieces; with a
        reasoning parser, the thinking first, as reasoning_content."""
        reasoning, text = self._split_reasoning(delta)
        if self.tool_stream is None:
            return DeltaMessage(reasoning_content=reasoning or None, content=text or None)
        content, calls = self.tool_stream.feed(text)
        if delta.finish_reason is not None:
            rest, more = self.tool_stream.finish(delta.finish_reason)
            content, calls = content + rest, calls + more
        self.num_streamed_calls = max(self.num_streamed_calls, len({c.index for c in calls}))
        return DeltaMessage(
            reasoning_content=reasoning or None, content=content or None, tool_calls=calls or None
        )

    def _split_reasoning(self, delta: RequestOutputDelta) -> tuple[str, str]:
        if self.reasoning_stream is None:
            return "", delta.text
        reasoning, content = self.reasoning_stream.feed(delta.text)
        if delta.finish_reason is not None:
            more_reasoning, more_content = self.reasoning_stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _finish_reason(self, num_calls: int) -> str | None:
        if self.finish_reason is None:
            return None
        return finish_reason_of(self.tools, num_calls, self.finish_reason)

    def final(self, echo: str) -> ChatChoice:
        text = "".join(self.text)
        reasoning: str | msgspec.UnsetType | None = msgspec.UNSET
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.split(text)
            text = answer or ""
        extracted = extract_tool_calls(self.tools, text, self.finish_reason)
        content = echo + (extracted.content or "")
        return ChatChoice(
            index=self.index,
            message=ChatMessageOut(
                role=_ASSISTANT,
                content=content if content or not extracted.calls else None,
                reasoning_content=reasoning,
                tool_calls=extracted.calls or msgspec.UNSET,
            ),
            logprobs=ChatLogprobs(content=self.logprobs) if self.want_logprobs else None,
            finish_reason=self._finish_reason(len(extracted.calls)),
            stop_reason=self.stop_reason,
        )


def _token_logprob(
    ctx: ServingContext, entry: TokenLogprobs, strings: list[str] | None
) -> ChatTokenLogprob:
    texts = ctx.token_strings(entry, strings)
    top = [
        ChatTopLogprob(token=t, logprob=clamp_logprob(lp), bytes_=token_bytes(t))
        for t, lp in zip(texts[1:], entry.logprobs[1:])
    ]
    return ChatTokenLogprob(
        token=texts[0],
        logprob=clamp_logprob(entry.logprobs[0]),
        bytes_=token_bytes(texts[0]),
        top_logprobs=top,
    )


class _Chat(ServedRequest):
    """One /v1/chat/completions request after validation."""

    def __init__(
        self,
        ctx: ServingContext,
        request: ChatCompletionRequest,
        deadlines: RequestDeadlines,
    ) -> None:
        reasoning = reasoning_parser(ctx.config.reasoning_parser)
        params = request.to_sampling_params()  # validated in ctx.prepare, once per prompt
        params = gate_after_reasoning(
            params, reasoning, ctx.tokenizer, request.chat_template_kwargs
        )
        parallel = request.parallel_tool_calls is not False
        tools = tool_use(request.tools, request.tool_choice, parallel)
        images = chat_images(ctx.config.media, ctx.config.vision_model_dir)
        conversation, pictures = images.conversation(request)
        shown, template_tools = with_tools(conversation, tools, ctx.tokenizer.chat_template)
        token_ids = ctx.render_chat(
            shown, request.add_generation_prompt, template_tools, request.chat_template_kwargs
        )
        super().__init__(
            ctx,
            "chatcmpl",
            [prepare_chat_prompt(ctx, token_ids, pictures, params)],
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
        self.echo = _echo_text(request, conversation)
        self.choices = [
            _Choice(i, bool(request.logprobs), tools, reasoning) for i in range(params.n)
        ]
        self.resume_choices(self.choices)

    async def full(self) -> Response:
        async with aclosing(self.deltas()) as deltas:
            async for index, delta in deltas:
                self.choices[index].apply(self.ctx, delta)
        response = ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[c.final(self.echo) for c in self.choices],
            usage=self.usage(self.choices),
            prompt_token_ids=self.ids_if(self.return_ids, self.prompts[0].token_ids),
        )
        for choice, counts in zip(response.choices, self.choices):
            choice.token_ids = self.ids_if(self.return_ids, counts.token_ids)
        return json_response(response)

    async def stream(self) -> AsyncGenerator[bytes, None]:
        resumed = self.resumed or {}  # these choices' role chunks went out already
        for choice in [c for c in self.choices if c.index not in resumed]:
            first = DeltaMessage(role=_ASSISTANT, content=self.echo)
            yield sse_event(self._chunk([ChatChunkChoice(index=choice.index, delta=first)]))
        async with aclosing(self.deltas()) as deltas:
            async for index, delta in deltas:
                part = self.choices[index].apply(self.ctx, delta)
                part.token_ids = self.ids_if(self.return_ids, delta.token_ids)
                delta_message = part.delta
                if (
                    delta_message.content
                    or delta_message.reasoning_content
                    or delta_message.tool_calls
                    or part.logprobs
                    or part.token_ids
                    or part.finish_reason is not None
                    or (delta.token_ids and self.choices[index].chunk_per_token)
                ):
                    yield sse_event(self._chunk([part]))
        if self.include_usage:
            yield sse_event(self._chunk([], usage=True))

    def _chunk(self, choices: list[ChatChunkChoice], usage: bool = False) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(self.choices) if usage else None,
        )


def _echo_text(request: ChatCompletionRequest, conversation: list[dict[str, object]]) -> str:
    if not request.echo:
        return ""
    last = conversation[-1]
    generated_role = _ASSISTANT if request.add_generation_prompt else last["role"]
    return str(last["content"]) if last["role"] == generated_role else ""


def prepare_chat_completion(
    ctx: ServingContext, body: bytes, headers: Mapping[str, str]
) -> tuple[ServedRequest, bool]:
    """A validated /v1/chat/completions body, ready to run, and whether it streams (call
    on the event loop); raises what becomes the error response. `kvflow run-batch` too."""
    check_generating(ctx)
    request = decode_request(body, ChatCompletionRequest)
    ctx.check_model(request.model)
    deadlines = request_deadlines(request.timeout, headers, bool(request.stream))
    chat = _Chat(ctx, request, deadlines)
    ctx.check_engine(request.data_parallel_rank)
    return chat, bool(request.stream)


async def create_chat_completion(ctx: ServingContext, raw: Request, body: bytes) -> Response:
    chat, stream = prepare_chat_completion(ctx, body, raw.headers)
    ignored = ignored_fields(body, ChatCompletionRequest)
    return mark_ignored(await chat.respond(raw, stream), ignored)

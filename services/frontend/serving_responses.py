"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on top of the
chat path (the same chat template, tool calling, structured outputs and engine).

    input items + instructions + the stored conversation of previous_response_id
      ─▶ chat messages (responses_input.py) ─▶ chat template ─▶ one prompt, n = 1
      ─▶ engine deltas ─▶ OutputBuilder (responses_output.py) ─▶ output items / events
      ─▶ the response object (stored unless `store: false`, response_store.py)

Failures before the first token are HTTP errors in OpenAI's shape (a stream's status
line waits for it); after that, a stream ends with an `error` event.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from http import HTTPStatus

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvflow.errors import InvalidRequestError
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.services.frontend.choice_counts import ChoiceCounts
from kvflow.services.frontend.errors import CLIENT_CLOSED_REQUEST, APIError, error_info
from kvflow.services.frontend.ignored_fields import ignored_fields, mark_ignored
from kvflow.services.frontend.protocol import decode_request
from kvflow.services.frontend.reasoning import gate_after_reasoning, reasoning_parser
from kvflow.services.frontend.request_deadline import RequestDeadlines, request_deadlines
from kvflow.services.frontend.response_store import ResponseStore, StoredResponse
from kvflow.services.frontend.responses_events import (
    ErrorEvent,
    ResponseCompleted,
    ResponseCreated,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
    encode_event,
)
from kvflow.services.frontend.responses_input import (
    Message,
    conversation,
    fold_tool_calls,
    input_messages,
    output_messages,
    request_tool_use,
    sampling_params,
)
from kvflow.services.frontend.responses_output import OutputBuilder, new_item_id
from kvflow.services.frontend.responses_protocol import (
    IncompleteDetails,
    ReasoningItem,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
)
from kvflow.services.frontend.runner_routes import check_generating
from kvflow.services.frontend.serving_common import (
    ServedRequest,
    ServingContext,
    json_response,
)
from kvflow.services.frontend.sse import (
    SSEResponse,
    read_body,
    unless_disconnected,
    until_disconnect,
)
from kvflow.services.frontend.tool_calling import with_tools


class _EventStream(SSEResponse):
    """SSEResponse's disconnect handling without its chat framing: Responses events
    are `event:` + `data:` frames and the stream ends without `data: [DONE]`."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        StreamingResponse.__init__(self, events, headers={"Cache-Control": "no-cache"})
        self._body = events


class _Response(ServedRequest):
    """One /v1/responses request after validation."""

    def __init__(
        self,
        ctx: ServingContext,
        store: ResponseStore,
        request: ResponsesRequest,
        deadlines: RequestDeadlines,
    ) -> None:
        self.use = request_tool_use(request)
        self.reasoning = reasoning_parser(ctx.config.reasoning_parser)
        params = sampling_params(request, self.use)
        params = gate_after_reasoning(params, self.reasoning, ctx.tokenizer, None)
        history = _history(store, request.previous_response_id)
        self.messages = [*history, *input_messages(request.input)]
        if not self.messages:  # e.g. only reasoning items, which stay out of the prompt
            raise InvalidRequestError("input holds no message to answer", param="input")
        template = ctx.tokenizer.chat_template
        shown = conversation(request.instructions, [], self.messages)
        shown, template_tools = with_tools(shown, self.use, template)
        token_ids = ctx.render_chat(fold_tool_calls(shown, template), True, template_tools)
        super().__init__(
            ctx,
            "resp",
            [ctx.prepare_ids(token_ids, params, None)],
            priority=request.priority,
            cache_salt=request.cache_salt,
            model=request.model,
            arrival_time=time.time(),
            deadlines=deadlines,
        )
        self.id = new_item_id("resp")  # OpenAI's spelling, resp_<hex>
        self.store = store if request.store is not False else None
        self.counts = ChoiceCounts()
        self.builder = OutputBuilder(self.use, self.reasoning)
        self.finish_reason: str | None = None
        self.template = _template(request, self.id, self.created, self.model)

    async def respond(self, raw: Request, stream: bool) -> Response:
        if not stream:
            return await until_disconnect(raw, self.full())
        if await unless_disconnected(raw.receive, self._open()) is None:
            await self.close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return _EventStream(self.stream())

    async def full(self) -> Response:
        async with aclosing(self.deltas()) as deltas:
            async for _, delta in deltas:
                self._fold(delta)
        self.builder.finish(self.finish_reason)
        return json_response(self._finished())

    async def stream(self) -> AsyncGenerator[bytes, None]:
        numbers = itertools.count()

        def frame(event: ResponseEvent) -> bytes:
            event.sequence_number = next(numbers)
            return encode_event(event)

        yield frame(ResponseCreated(response=self.template))
        yield frame(ResponseInProgress(response=self.template))
        try:
            async with aclosing(self.deltas()) as deltas:
                async for _, delta in deltas:
                    for event in self._fold(delta):
                        yield frame(event)
            for event in self.builder.finish(self.finish_reason):
                yield frame(event)
            response = self._finished()
            done = ResponseCompleted if response.status == "completed" else ResponseIncomplete
            yield frame(done(response=response))
        except Exception as exc:  # the status line is out: report it in-band
            _, info = error_info(exc)
            code = info.code if info.code is not None else info.type
            yield frame(ErrorEvent(message=info.message, code=code, param=info.param))

    def _fold(self, delta: RequestOutputDelta) -> list[ResponseEvent]:
        self.counts.count(delta)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return self.builder.feed(delta.text)

    def _finished(self) -> ResponseObject:
        """The final response object; stored unless the request said `store: false`."""
        incomplete = self.builder.status == "incomplete"
        response = msgspec.structs.replace(
            self.template,
            status=self.builder.status,
            output=self.builder.output,
            usage=ResponseUsage.of(
                len(self.prompts[0].token_ids),
                self.counts.num_tokens,
                self.counts.num_cached_tokens,
                self._reasoning_tokens(),
            ),
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
        )
        if self.store is not None:
            messages = [*self.messages, *output_messages(response.output)]
            self.store.put(StoredResponse(response, messages))
        return response

    def _reasoning_tokens(self) -> int:
        """Output tokens up to the thinking's end tag (all of them if it never ended)."""
        if self.reasoning is None or not any(
            isinstance(o, ReasoningItem) for o in self.builder.output
        ):
            return 0
        end = self.ctx.encode(self.reasoning.end_tag, add_special_tokens=False)
        ids = self.counts.token_ids
        for at in range(len(ids) - len(end) + 1):
            if ids[at : at + len(end)] == end:
                return at + len(end)
        return len(ids)


def _history(store: ResponseStore, previous_response_id: str | None) -> list[Message]:
    if previous_response_id is None:
        return []
    previous = store.get(previous_response_id)
    if previous is None:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"previous response with id {previous_response_id!r} not found",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(previous.messages)


def _template(
    request: ResponsesRequest, response_id: str, created: int, model: str
) -> ResponseObject:
    """The response as it starts: the request's settings echoed, no output yet."""
    return ResponseObject(
        id=response_id,
        created_at=created,
        status="in_progress",
        model=model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature if request.temperature is not None else 1.0,
        top_p=request.top_p if request.top_p is not None else 1.0,
        tools=request.tools or [],
        tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        text=request.text or TextConfig(format=TextFormat(type="text")),
        previous_response_id=request.previous_response_id,
        store=request.store is not False,
        metadata=request.metadata or {},
        user=request.user,
    )


class ResponsesAPI:
    """The two routes, sharing one store (FrontendConfig.max_stored_responses)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.store = ResponseStore(ctx.config.max_stored_responses)

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, self.ctx.config.max_body_bytes)
        check_generating(self.ctx)
        request = decode_request(body, ResponsesRequest)
        self.ctx.check_model(request.model)
        deadlines = request_deadlines(request.timeout, raw.headers, bool(request.stream))
        response = _Response(self.ctx, self.store, request, deadlines)
        self.ctx.check_engine()
        ignored = ignored_fields(body, ResponsesRequest)
        return mark_ignored(await response.respond(raw, bool(request.stream)), ignored)

    async def retrieve(self, raw: Request) -> Response:
        response_id = raw.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"response with id {response_id!r} not found",
                error_type="not_found_error",
                param="response_id",
            )
        return json_response(stored.response)

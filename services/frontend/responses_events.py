"""The semantic SSE events of a streamed response, as OpenAI sends them.

    response.created, response.in_progress           the response, status in_progress
    per output item (a message, or a function call):
      response.output_item.added                      the item, empty, in_progress
      message:  response.content_part.added           an empty output_text part
                response.output_text.delta ...        the text as it is generated
                response.output_text.done             the whole text
                response.content_part.done            the finished part
      reasoning (first, with --reasoning-parser): the same with a reasoning_text part
                and response.reasoning_text.delta / .done
      call:     response.function_call_arguments.delta ...
                response.function_call_arguments.done the whole arguments
      response.output_item.done                       the finished item
    response.completed | response.incomplete          the final response (incomplete:
                                                      cut by max_output_tokens)
    error                                             a failure after the stream began

Every event has `type` (its tag) and `sequence_number` (0, 1, 2, ... per stream). On the
wire each is `event: <type>` + `data: <json>`; there is no `[DONE]`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.services.frontend.responses_protocol import (
    OutputItem,
    OutputText,
    ReasoningText,
    ResponseObject,
)


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0


class ResponseCreated(_Event, kw_only=True, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, kw_only=True, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(_Event, kw_only=True, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(_Event, kw_only=True, tag="response.incomplete"):
    response: ResponseObject


class OutputItemAdded(_Event, kw_only=True, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, kw_only=True, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, kw_only=True, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class ContentPartDone(_Event, kw_only=True, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class ReasoningTextDelta(_Event, kw_only=True, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDone(_Event, kw_only=True, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class OutputTextDelta(_Event, kw_only=True, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, kw_only=True, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class FunctionCallArgumentsDelta(
    _Event, kw_only=True, tag="response.function_call_arguments.delta"
):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, kw_only=True, tag="error"):
    message: str
    code: str | int | None = None
    param: str | None = None


ResponseEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ErrorEvent
)

_ENCODER = msgspec.json.Encoder()


def event_type(event: ResponseEvent) -> str:
    return str(type(event).__struct_config__.tag)


def encode_event(event: ResponseEvent) -> bytes:
    """One SSE frame: `event: <type>` and `data: <json>`."""
    return b"event: " + event_type(event).encode() + b"\ndata: " + _ENCODER.encode(event) + b"\n\n"

"""Generated text in, Responses output items and their stream events out.

One builder serves both a streamed and a whole response (the whole one drops the
events), so the two cannot disagree. Text goes through the chat path's ToolCallStream:
content becomes a `message` item with one `output_text` part, each tool call a
`function_call` item. Items are opened when their first piece arrives, in that order;
a message is closed when a call opens after it. A response with no content and no
call still gets one (empty) message, as OpenAI's does. With a reasoning parser the
thinking comes first, as a `reasoning` item with one `reasoning_text` part, closed when
the answer's first item opens.
"""

from __future__ import annotations

import uuid

from kvflow.services.frontend.reasoning import ReasoningParser
from kvflow.services.frontend.responses import DeltaToolCall
from kvflow.services.frontend.responses_events import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseEvent,
)
from kvflow.services.frontend.responses_protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)
from kvflow.services.frontend.tool_calling import ToolUse
from kvflow.services.frontend.tool_parser import ToolCallStream


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _OpenMessage:
    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_item_id("msg")
        self.text: list[str] = []


class _OpenCall:
    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index = index
        self.id = new_item_id("fc")
        self.call_id = call_id
        self.name = name
        self.arguments: list[str] = []


class _OpenReasoning:
    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_item_id("rs")
        self.text: list[str] = []


class OutputBuilder:
    def __init__(self, use: ToolUse, reasoning: ReasoningParser | None = None) -> None:
        self.stream = ToolCallStream(use)
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.output: list[OutputItem] = []  # finished items, in output_index order
        self.status = "in_progress"
        self._count = 0  # items opened so far
        self._thinking: _OpenReasoning | None = None
        self._message: _OpenMessage | None = None
        self._calls: dict[int, _OpenCall] = {}  # by the tool-call stream's index

    def feed(self, piece: str) -> list[ResponseEvent]:
        thought, answer = self.reasoning.feed(piece) if self.reasoning else ("", piece)
        content, calls = self.stream.feed(answer)
        return self._think(thought) + self._emit(content, calls)

    def finish(self, finish_reason: str | None) -> list[ResponseEvent]:
        """Close every item; `length` (max_output_tokens) makes the response incomplete."""
        self.status = "incomplete" if finish_reason == "length" else "completed"
        events: list[ResponseEvent] = []
        if self.reasoning is not None:
            thought, answer = self.reasoning.finish()
            events += self._think(thought) + self._emit(*self.stream.feed(answer))
        content, calls = self.stream.finish(finish_reason)
        events += self._emit(content, calls)
        if self._thinking is not None:
            events += self._close_reasoning()
        if self._count == 0:
            events += self._open_message()
        if self._message is not None:
            events += self._close_message()
        for call in self._calls.values():
            events += self._close_call(call)
        self._calls.clear()
        return events

    @property
    def text(self) -> str:
        """The output_text of all message items."""
        parts = [p.text for o in self.output if isinstance(o, OutputMessage) for p in o.content]
        return "".join(parts)

    def _think(self, thought: str) -> list[ResponseEvent]:
        if not thought:
            return []
        events: list[ResponseEvent] = []
        if self._thinking is None:
            self._thinking = _OpenReasoning(self._next_index())
            added = ReasoningItem(id=self._thinking.id, status="in_progress")
            events += [
                OutputItemAdded(output_index=self._thinking.index, item=added),
                ContentPartAdded(
                    item_id=self._thinking.id,
                    output_index=self._thinking.index,
                    part=ReasoningText(text=""),
                ),
            ]
        self._thinking.text.append(thought)
        item_id, index = self._thinking.id, self._thinking.index
        return [*events, ReasoningTextDelta(item_id=item_id, output_index=index, delta=thought)]

    def _close_reasoning(self) -> list[ResponseEvent]:
        thinking, self._thinking = self._thinking, None
        assert thinking is not None
        part = ReasoningText(text="".join(thinking.text))
        status = "incomplete" if self.status == "incomplete" else "completed"
        item = ReasoningItem(id=thinking.id, status=status, content=[part])
        self.output.append(item)
        item_id, index = thinking.id, thinking.index
        return [
            ReasoningTextDone(item_id=item_id, output_index=index, text=part.text),
            ContentPartDone(item_id=item_id, output_index=index, part=part),
            OutputItemDone(output_index=index, item=item),
        ]

    def _emit(self, content: str, calls: list[DeltaToolCall]) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if (content or calls) and self._thinking is not None:
            events += self._close_reasoning()
        if content:
            if self._message is None:
                events += self._open_message()
            assert self._message is not None
            self._message.text.append(content)
            events.append(
                OutputTextDelta(
                    item_id=self._message.id, output_index=self._message.index, delta=content
                )
            )
        for piece in calls:
            function = piece.function
            if piece.id is not None:
                events += self._open_call(
                    piece.index, piece.id, function.name if function else None
                )
            call = self._calls[piece.index]
            if function is not None and function.arguments:
                call.arguments.append(function.arguments)
                events.append(
                    FunctionCallArgumentsDelta(
                        item_id=call.id, output_index=call.index, delta=function.arguments
                    )
                )
        return events

    def _open_message(self) -> list[ResponseEvent]:
        self._message = message = _OpenMessage(self._next_index())
        added = OutputMessage(id=message.id, status="in_progress")
        return [
            OutputItemAdded(output_index=message.index, item=added),
            ContentPartAdded(
                item_id=message.id, output_index=message.index, part=OutputText(text="")
            ),
        ]

    def _close_message(self) -> list[ResponseEvent]:
        message, self._message = self._message, None
        assert message is not None
        part = OutputText(text="".join(message.text))
        status = "incomplete" if self.status == "incomplete" else "completed"
        item = OutputMessage(id=message.id, status=status, content=[part])
        self.output.append(item)
        index = message.index
        return [
            OutputTextDone(item_id=message.id, output_index=index, text=part.text),
            ContentPartDone(item_id=message.id, output_index=index, part=part),
            OutputItemDone(output_index=index, item=item),
        ]

    def _open_call(self, stream_index: int, call_id: str, name: str | None) -> list[ResponseEvent]:
        events = self._close_message() if self._message is not None else []
        call = _OpenCall(self._next_index(), call_id, name or "")
        self._calls[stream_index] = call
        added = FunctionCallItem(
            id=call.id, call_id=call_id, name=call.name, arguments="", status="in_progress"
        )
        events.append(OutputItemAdded(output_index=call.index, item=added))
        return events

    def _close_call(self, call: _OpenCall) -> list[ResponseEvent]:
        arguments = "".join(call.arguments)
        item = FunctionCallItem(
            id=call.id,
            call_id=call.call_id,
            name=call.name,
            arguments=arguments,
            status="completed",
        )
        self.output.append(item)
        return [
            FunctionCallArgumentsDone(
                item_id=call.id, output_index=call.index, name=call.name, arguments=arguments
            ),
            OutputItemDone(output_index=call.index, item=item),
        ]

    def _next_index(self) -> int:
        self._count += 1
        return self._count - 1

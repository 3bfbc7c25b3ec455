"""Tool calls out of generated text: whole (a response) and incremental (a stream).

    mode       the text is                                   calls
    named      the arguments object (guided)                 one call of the function
    required   [{"name": N, "parameters": {...}}, ...]       one per item (guided)
    auto       free text with Hermes-style blocks             one per parsable block; the
               <tool_call>{"name", "arguments"}</tool_call>  text before them is content

A choice cut by max_tokens ("length") is never passed off as a call: its text stays
content. In a stream, content is sent as it comes except what may be the start of a
tool-call block; calls are sent as OpenAI's `tool_calls` deltas (for a named function
the arguments stream as they are generated; otherwise each call is sent whole when the
choice ends, since only then does its JSON parse).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from kvflow.services.frontend.responses import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from kvflow.services.frontend.tool_calling import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolUse

_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Extracted:
    content: str | None
    calls: list[ToolCallOut] = field(default_factory=list)


def extract_tool_calls(use: ToolUse, text: str, finish_reason: str | None) -> Extracted:
    """The content and calls of a finished choice's text."""
    if use.mode in ("none",) or finish_reason == "length":
        return Extracted(text)
    if use.mode == "named":
        assert use.function is not None
        return Extracted(None, [_call(use.function, text.strip())])
    if use.mode == "required":
        return _required_calls(text)
    return _auto_calls(use, text)


def _call(name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=name, arguments=arguments))


def _required_calls(text: str) -> Extracted:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return Extracted(text)  # the grammar rules this out unless the output was cut
    calls = [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
    return Extracted(None, calls)


def _auto_calls(use: ToolUse, text: str) -> Extracted:
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return Extracted(text)
    calls = []
    names = {tool.function.name for tool in use.tools}
    for match in _BLOCK.finditer(text, start):
        call = _parse_block(match.group(1), names)
        if call is None:
            return Extracted(text)  # not a well-formed call: leave the text as it is
        calls.append(call)
    if not use.parallel:
        calls = calls[:1]
    content = text[:start].strip()
    return Extracted(content or None, calls)


def _parse_block(body: str, names: set[str]) -> ToolCallOut | None:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return _call(value["name"], arguments)
    return _call(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """One streamed choice: text deltas in, content and tool_calls deltas out."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.call_id = new_call_id()
        self.named_started = False  # the named call's first delta (with its id) is out

    def feed(self, piece: str) -> tuple[str, list[DeltaToolCall]]:
        """Content to send now, and tool_calls deltas (named: the arguments so far)."""
        self.text += piece
        if self.use.mode == "named":
            return "", self._named_delta(piece)
        if self.use.mode == "required":
            return "", []
        end = len(self.text) if self.use.mode == "none" else self._safe_end()
        content, self.sent = self.text[self.sent : end], max(self.sent, end)
        return content, []

    def finish(self, finish_reason: str | None) -> tuple[str, list[DeltaToolCall]]:
        """What is left to send when the choice ends."""
        if self.use.mode in ("none", "named"):
            return "", []
        extracted = extract_tool_calls(self.use, self.text, finish_reason)
        if not extracted.calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        return "", [_whole_delta(i, call) for i, call in enumerate(extracted.calls)]

    def _named_delta(self, piece: str) -> list[DeltaToolCall]:
        if not piece and self.named_started:
            return []
        function = DeltaFunctionCall(arguments=piece)
        if not self.named_started:  # the first delta names the call
            self.named_started = True
            function = DeltaFunctionCall(name=self.use.function, arguments=piece)
            return [DeltaToolCall(index=0, id=self.call_id, type="function", function=function)]
        return [DeltaToolCall(index=0, function=function)]

    def _safe_end(self) -> int:
        """Where content may be sent up to: before a block, or before a tail that may
        still grow into one."""
        start = self.text.find(TOOL_CALL_OPEN)
        if start >= 0:
            return start
        for keep in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text)), 0, -1):
            if TOOL_CALL_OPEN.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)


def _whole_delta(index: int, call: ToolCallOut) -> DeltaToolCall:
    function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
    return DeltaToolCall(index=index, id=call.id, type="function", function=function)


def finish_reason_of(use: ToolUse, calls: int, finish_reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a forced
    named call ends with "stop"."""
    if calls and finish_reason == "stop" and use.mode in ("auto", "required"):
        return "tool_calls"
    return finish_reason

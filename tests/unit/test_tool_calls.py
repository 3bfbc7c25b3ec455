"""Tool calling in the frontend: tool_choice resolution, the guiding schema, and the
parsers (whole responses and streams)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.services.frontend.protocol import ChatCompletionRequest
from kvflow.services.frontend.tool_calling import (
    NamedFunction,
    NamedToolChoice,
    ToolSpec,
    tool_use,
    with_tools,
)
from kvflow.services.frontend.tool_parser import (
    ToolCallStream,
    extract_tool_calls,
    finish_reason_of,
)

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
       "required": ["a"]}}  # fmt: skip
NOW = {"name": "now", "parameters": {"type": "object", "properties": {}}}
TOOLS = [msgspec.convert({"type": "function", "function": f}, ToolSpec) for f in (ADD, NOW)]


def request(**body: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return msgspec.convert(body, ChatCompletionRequest)


def test_required_schema_accepts_calls_and_nothing_else() -> None:
    raw = [msgspec.to_builtins(t) for t in TOOLS]
    params = request(tools=raw, tool_choice="required").to_sampling_params()
    schema = params.structured_outputs.json  # type: ignore[union-attr]
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], schema)
    for bad in ([], [{"name": "add", "parameters": {}}], [{"name": "sub", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = request(tools=raw, tool_choice="required", parallel_tool_calls=False)
    assert single.to_sampling_params().structured_outputs.json["maxItems"] == 1  # type: ignore[union-attr,index]


def test_named_choice_guides_by_the_function_schema() -> None:
    raw = [msgspec.to_builtins(t) for t in TOOLS]
    named = {"type": "function", "function": {"name": "add"}}
    params = request(tools=raw, tool_choice=named).to_sampling_params()
    assert params.structured_outputs.json == ADD["parameters"]  # type: ignore[union-attr]
    assert request(tools=raw, tool_choice="auto").to_sampling_params().structured_outputs is None
    with pytest.raises(InvalidRequestError) as info:
        request(
            tools=raw, tool_choice=named, response_format={"type": "json_object"}
        ).to_sampling_params()
    assert info.value.param == "tool_choice"


def test_extract_whole_outputs() -> None:
    required = tool_use(TOOLS, "required", True)
    out = extract_tool_calls(required, '[{"name": "add", "parameters": {"a": 2}}, '
                             '{"name": "now", "parameters": {}}]', "stop")  # fmt: skip
    assert [c.function.name for c in out.calls] == ["add", "now"] and out.content is None
    assert json.loads(out.calls[0].function.arguments) == {"a": 2}
    auto = tool_use(TOOLS, "auto", False)
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n' \
           '<tool_call>{"name": "now", "arguments": {}}</tool_call>'  # fmt: skip
    out = extract_tool_calls(auto, text, "stop")
    assert out.content == "Let me add." and [c.function.name for c in out.calls] == ["add"]
    assert finish_reason_of(auto, len(out.calls), "stop") == "tool_calls"
    cut = extract_tool_calls(required, '[{"name": "add", "param', "length")
    assert cut.calls == [] and cut.content == '[{"name": "add", "param'
    junk = extract_tool_calls(auto, "<tool_call>{not json</tool_call>", "stop")
    assert junk.calls == [] and junk.content == "<tool_call>{not json</tool_call>"


def test_auto_stream_holds_back_a_possible_block_start() -> None:
    stream = ToolCallStream(tool_use(TOOLS, "auto", True))
    sent = ""
    pieces = ["Sure", " <tool", "_call>", '{"name": "now", ', '"arguments": {}}', "</tool_call>"]
    for piece in pieces:
        content, calls = stream.feed(piece)
        sent += content
        assert not calls
    assert sent == "Sure "
    content, calls = stream.finish("stop")
    assert content == "" and len(calls) == 1 and calls[0].function.name == "now"  # type: ignore[union-attr]
    plain = ToolCallStream(tool_use(TOOLS, "auto", True))
    texts = [plain.feed(p)[0] for p in ["a <", "b"]] + [plain.finish("stop")[0]]
    assert "".join(texts) == "a <b"  # a "<" that did not become a block is sent after all


def test_named_stream_sends_arguments_as_they_come() -> None:
    named = NamedToolChoice(function=NamedFunction("add"))
    stream = ToolCallStream(tool_use(TOOLS, named, True))
    first = stream.feed('{"a"')[1][0]
    second = stream.feed(": 3}")[1][0]
    assert first.id and first.function.name == "add" and first.function.arguments == '{"a"'  # type: ignore[union-attr]
    assert second.id is None and second.function.arguments == ": 3}"  # type: ignore[union-attr]


def test_templates_without_tools_get_the_tools_prompt() -> None:
    use = tool_use(TOOLS, "auto", True)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    shown, template_tools = with_tools(conversation, use, "{{ messages }}")
    assert template_tools is None and "Be brief." in shown[0]["content"]
    assert '"name": "add"' in shown[0]["content"] and "<tool_call>" in shown[0]["content"]
    shown, template_tools = with_tools(conversation, use, "{% for t in tools %}{% endfor %}")
    assert shown == conversation and template_tools and len(template_tools) == 2
    none = tool_use(TOOLS, "none", True)
    assert with_tools(conversation, none, None) == (conversation, None)


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": 5},  # a map field that is not an object
        {"$ref": "#/$defs/loop", "$defs": {"loop": {"$ref": "#/$defs/loop"}}},  # no text fits
    ],
)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_a_tool_schema_no_call_can_satisfy_is_a_400(parameters: Any, choice: Any) -> None:
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    with pytest.raises(InvalidRequestError) as info:
        request(tools=[bad], tool_choice=choice).to_sampling_params()
    assert info.value.param == "tools"
    auto = request(tools=[bad], tool_choice="auto").to_sampling_params()  # not guided: fine
    assert auto.structured_outputs is None

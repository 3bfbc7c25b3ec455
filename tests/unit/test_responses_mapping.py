"""The Responses API's pure parts: input items -> chat messages, tools and text.format
-> the chat path's terms, the LRU store, and the output builder's event sequence."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvflow.errors import ConfigError, InvalidRequestError
from kvflow.services.frontend.protocol import decode_request
from kvflow.services.frontend.response_store import ResponseStore, StoredResponse
from kvflow.services.frontend.responses_events import encode_event, event_type
from kvflow.services.frontend.responses_input import (
    conversation,
    fold_tool_calls,
    input_messages,
    output_messages,
    request_tool_use,
    sampling_params,
    text_format,
)
from kvflow.services.frontend.responses_output import OutputBuilder
from kvflow.services.frontend.responses_protocol import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
)
from kvflow.services.frontend.tool_calling import ToolUse, tool_use

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def request(**body: Any) -> ResponsesRequest:
    return decode_request(json.dumps({"input": "hi", **body}).encode(), ResponsesRequest)


# --- input items -> messages -----------------------------------------------------------


def test_string_input_is_one_user_turn() -> None:
    assert input_messages("Hello") == [{"role": "user", "content": "Hello"}]


def test_items_map_to_chat_messages() -> None:
    items = request(
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "41"},
            {"type": "function_call_output", "call_id": "c2", "output": "1"},
            {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        ]
    ).input  # fmt: skip
    assert not isinstance(items, str)
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "41"},
        {"role": "tool", "tool_call_id": "c2", "content": "1"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
        ({"type": "function_call_output", "call_id": "c"}, "input[0].output"),
        ({"type": "message", "content": "x"}, "input[0].role"),
        ({"role": "user"}, "input[0].content"),
    ],
)
def test_an_item_missing_a_field_is_a_400_naming_it(item: dict[str, Any], param: str) -> None:
    items = request(input=[item]).input
    assert not isinstance(items, str)
    with pytest.raises(InvalidRequestError) as info:
        input_messages(items)
    assert info.value.param == param


@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"type": "web_search_call", "id": "ws_1"}]},
        {"input": []},
        {"input": ""},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"text": {"format": {"type": "xml"}}},
        {"max_output_tokens": 0},
    ],
)
def test_bad_bodies_fail_to_decode(body: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        request(**body)


def test_instructions_lead_and_output_becomes_assistant_turns() -> None:
    history = [{"role": "user", "content": "q"}]
    assert conversation("Be kind.", history, [{"role": "user", "content": "r"}]) == [
        {"role": "system", "content": "Be kind."},
        *history,
        {"role": "user", "content": "r"},
    ]
    output = [
        OutputMessage(id="m", status="completed", content=[OutputText(text="Sure.")]),
        FunctionCallItem(id="fc", call_id="c", name="f", arguments="{}", status="completed"),
    ]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    expected = [{"role": "assistant", "content": "Sure.", "tool_calls": [call]}]
    assert output_messages(output) == expected


def test_tool_calls_fold_into_content_for_templates_without_them() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    folded = fold_tool_calls(messages, "{{ m['content'] }}")
    assert folded == [
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        }
    ]
    assert fold_tool_calls(messages, "{{ m.tool_calls }}") == messages


# --- tools, text.format, sampling --------------------------------------------------------


def test_flat_function_tools_and_named_choice() -> None:
    use = request_tool_use(
        request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    )
    assert use.mode == "named" and use.function == "get_weather"
    assert use.tools[0].function.parameters == WEATHER["parameters"]
    assert request_tool_use(request(tools=[WEATHER])).mode == "auto"
    assert request_tool_use(request()).mode == "none"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400s(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request_tool_use(request(**body))
    assert info.value.param == param


def test_text_format_goes_through_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    params = text_format(request(text={"format": fmt}).text)
    assert params is not None and params.json == schema
    json_object = text_format(request(text={"format": {"type": "json_object"}}).text)
    assert json_object is not None and json_object.json_object
    assert text_format(request(text={"format": {"type": "text"}}).text) is None
    assert text_format(None) is None


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name"),
        ({"type": "json_schema", "name": "x", "schema": {"type": "nope"}}, "text.format.schema"),
    ],
)
def test_bad_text_format_is_a_400_naming_text_format(fmt: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        text_format(request(text={"format": fmt}).text)
    assert info.value.param == param


def test_sampling_params() -> None:
    r = request(max_output_tokens=7, temperature=0, top_p=0.5, ignore_eos=True, stop="x")
    params = sampling_params(r, request_tool_use(r))
    assert (params.max_tokens, params.temperature, params.top_p) == (7, 0.0, 0.5)
    assert params.ignore_eos and params.stop == ["x"] and params.n == 1
    extras = request(bad_words=["no way"], allowed_token_ids=[5, 6])
    params = sampling_params(extras, request_tool_use(extras))
    assert params.bad_words == ["no way"] and params.allowed_token_ids == [5, 6]
    both = request(
        tools=[WEATHER], tool_choice="required", text={"format": {"type": "json_object"}}
    )
    with pytest.raises(InvalidRequestError):
        sampling_params(both, request_tool_use(both))


# --- the store -----------------------------------------------------------------------------


def stored(response_id: str) -> StoredResponse:
    response = ResponseObject(id=response_id, created_at=0, status="completed", model="m")
    return StoredResponse(response, [{"role": "user", "content": response_id}])


def test_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put(stored("c"))  # evicts b
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_store_of_capacity_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    store.put(stored("a"))
    assert store.get("a") is None and len(store) == 0
    with pytest.raises(ConfigError):
        ResponseStore(-1)


# --- the output builder ------------------------------------------------------------------


def run(use: ToolUse, pieces: list[str], finish: str) -> tuple[OutputBuilder, list[Any]]:
    builder = OutputBuilder(use)
    events = [e for piece in pieces for e in builder.feed(piece)] + builder.finish(finish)
    for number, event in enumerate(events):
        event.sequence_number = number
    return builder, [json.loads(encode_event(e).split(b"data: ", 1)[1]) for e in events]


NO_TOOLS = tool_use(None, None, True)


def test_text_event_sequence() -> None:
    builder, events = run(NO_TOOLS, ["Hel", "lo"], "stop")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["item"]["status"] == "in_progress" and events[0]["item"]["content"] == []
    assert "".join(e["delta"] for e in events if "delta" in e) == "Hello"
    assert events[4]["text"] == "Hello" and events[-1]["item"]["status"] == "completed"
    assert len({e.get("item_id", e.get("item", {}).get("id")) for e in events}) == 1
    assert builder.status == "completed" and builder.text == "Hello"


def test_cut_by_length_is_incomplete_and_empty_output_has_a_message() -> None:
    builder, events = run(NO_TOOLS, ["a"], "length")
    assert builder.status == "incomplete" and events[-1]["item"]["status"] == "incomplete"
    empty, _ = run(NO_TOOLS, [""], "stop")
    assert [type(o) for o in empty.output] == [OutputMessage] and empty.text == ""


def test_auto_tool_call_closes_the_message_and_adds_a_call_item() -> None:
    use = request_tool_use(request(tools=[WEATHER]))
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    builder, events = run(use, ["Checking. ", call[:20], call[20:]], "stop")
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    message, function_call = builder.output
    assert isinstance(message, OutputMessage) and isinstance(function_call, FunctionCallItem)
    assert message.content[0].text == "Checking. "
    assert function_call.name == "get_weather"
    assert json.loads(function_call.arguments) == {"city": "Oslo"}
    assert events[6]["output_index"] == 1 and events[-1]["item"]["call_id"].startswith("call_")


def test_named_call_streams_its_arguments() -> None:
    use = request_tool_use(
        request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    )
    builder, events = run(use, ['{"city"', ': "Oslo"}'], "stop")
    deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    assert deltas == ['{"city"', ': "Oslo"}']
    assert event_type is not None and [type(o) for o in builder.output] == [FunctionCallItem]
    assert events[-2]["arguments"] == '{"city": "Oslo"}'

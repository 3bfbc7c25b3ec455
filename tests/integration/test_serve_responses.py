"""OpenAI's Responses API (`/v1/responses`) through a real `kvflow serve` with the
embedded SmolLM2, driven by the `openai` client exactly as agent frameworks drive it.

Greedy (temperature 0) with `ignore_eos` and a token budget, so that a streamed and a
whole response of the same request are the same tokens; built on the chat path, a
response's text is also the chat completion's text for the same conversation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from serve_harness import MODEL_NAME, Server, start_server, stop_server

from kvflow.gpu_worker.model_files import resolve_model_dir

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
BUDGET = 12
VERDICT = {
    "type": "object",
    "properties": {"sunny": {"type": "boolean"}, "sky": {"enum": ["blue", "grey"]}},
    "required": ["sunny", "sky"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(Path(resolve_model_dir(None)), tmp_path_factory.mktemp("serve"))
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def create(client: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("max_output_tokens", BUDGET)
    return client.responses.create(model=MODEL_NAME, **GREEDY, **kwargs)


def test_string_input_equals_the_chat_completion(client: Any) -> None:
    response = create(client, input="Name a color.", instructions="Answer briefly.")
    assert response.status == "incomplete"  # ignore_eos: the budget ends it
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == BUDGET
    assert response.usage.total_tokens == response.usage.input_tokens + BUDGET
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=BUDGET,
        **GREEDY,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_function_call_output_is_part_of_the_prompt(client: Any) -> None:
    ask = {"role": "user", "content": "What is the weather in Oslo?"}
    items = [
        ask,
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]  # fmt: skip
    alone = create(client, input=[ask], tools=[WEATHER])
    answered = create(client, input=items, tools=[WEATHER])
    assert answered.usage.input_tokens > alone.usage.input_tokens + 10
    assert answered.output and answered.usage.output_tokens == BUDGET


def test_text_format_json_schema_parses_and_validates(client: Any) -> None:
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    response = client.responses.create(
        model=MODEL_NAME, input="Is it sunny?", text={"format": fmt}, max_output_tokens=60
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), VERDICT)


def test_named_tool_choice_gives_a_valid_function_call(client: Any) -> None:
    response = client.responses.create(
        model=MODEL_NAME,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    call = response.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_previous_response_id_chains_and_retrieve(client: Any) -> None:
    first = create(client, input="My name is Ada.")
    second = create(client, input="What is my name?", previous_response_id=first.id)
    carried = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > carried
    # The prefix cache serves the earlier turns' tokens: a real continuation.
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.BadRequestError):
        create(client, input="x", previous_response_id="resp_missing")


def test_streamed_events_and_text_equal_the_whole_response(client: Any) -> None:
    whole = create(client, input="Tell me about the sea.")
    events = list(create(client, input="Tell me about the sea.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut by max_output_tokens, as OpenAI reports it
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == BUDGET


def test_stream_helper_final_response_equals_create(client: Any) -> None:
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT}
    kwargs: dict[str, Any] = {
        "input": "Is it sunny?",
        "text": {"format": fmt},
        "max_output_tokens": 60,
    }
    whole = client.responses.create(model=MODEL_NAME, temperature=0.0, **kwargs)
    with client.responses.stream(model=MODEL_NAME, temperature=0.0, **kwargs) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(texts) == final.output_text == whole.output_text
    jsonschema.validate(json.loads(final.output_text), VERDICT)

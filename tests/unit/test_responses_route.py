"""/v1/responses through the real app, EngineClient and sockets, against the fake engine
of test_frontend_app.py (canned pieces "[<prompt len>/0]", " hello", " world")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_frontend_app import MODEL, TOKENIZER, Harness, chat_ids, start_harness

EXPECTED = "[{n}/0] hello world"


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = start_harness(tmp_path_factory.mktemp("ipc"))
    yield harness
    harness.stop()


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    started: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        started.append(start_harness(tmp_path, **kwargs))
        return started[-1]

    yield make
    for harness in started:
        harness.stop()


def client(h: Harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0)


def events(h: Harness, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, payload) of a streamed response, read as raw SSE."""
    import json

    out: list[tuple[str, dict[str, Any]]] = []
    with h.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                assert line != "data: [DONE]"
                out.append((name, json.loads(line[len("data: ") :])))
    return out


def test_string_input_with_instructions(h: Harness) -> None:
    response = client(h).responses.create(model=MODEL, input="Hello", instructions="Be brief.")
    n = len(
        chat_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    )
    assert response.output_text == EXPECTED.format(n=n)
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output[0].type == "message"
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (n, 3, n + 3)
    assert usage.input_tokens_details.cached_tokens == 4
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert h.fake.added[-1].sampling_params.n == 1
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "text"  # the request's settings are echoed


def test_max_output_tokens_cut_is_incomplete(h: Harness) -> None:
    r = h.post("/v1/responses", {"input": "Hello", "max_output_tokens": 2})
    body = r.json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert h.fake.added[-1].sampling_params.max_tokens == 2


def test_function_call_output_items_reach_the_prompt(h: Harness) -> None:
    # The fake's context is 64 byte-tokens: too short for a folded function_call too
    # (test_responses_mapping.py and the served test cover that).
    items: Any = [
        {"role": "user", "content": "Q"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    response = client(h).responses.create(model=MODEL, input=items)
    assert response.output_text.endswith(" hello world")
    text = TOKENIZER.decode(h.fake.added[-1].prompt_token_ids)
    assert "<|im_start|>tool\nsunny<|im_end|>" in text


def test_previous_response_id_chains_and_get_retrieves(h: Harness) -> None:
    c = client(h)
    first = c.responses.create(model=MODEL, input="1", instructions="S", max_output_tokens=1)
    second = c.responses.create(model=MODEL, input="2", previous_response_id=first.id)
    conversation = [
        {"role": "user", "content": "1"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "2"},
    ]  # instructions are not carried over
    assert h.fake.added[-1].prompt_token_ids == chat_ids(conversation)
    assert second.previous_response_id == first.id
    got = c.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.retrieve("resp_nope")
    assert info.value.body["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert bad.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_store_false_is_not_retrievable(h: Harness) -> None:
    body = h.post("/v1/responses", {"input": "x", "store": False}).json()
    assert body["store"] is False
    assert h.http.get(f"/v1/responses/{body['id']}").status_code == 404


def test_store_bound_evicts(own: Callable[..., Harness]) -> None:
    h = own(max_stored_responses=1)
    first = h.post("/v1/responses", {"input": "a"}).json()["id"]
    second = h.post("/v1/responses", {"input": "b"}).json()["id"]
    assert h.http.get(f"/v1/responses/{first}").status_code == 404
    assert h.http.get(f"/v1/responses/{second}").status_code == 200


def test_stream_events_and_final_equal_the_whole(h: Harness) -> None:
    whole = h.post("/v1/responses", {"input": "Hello"}).json()
    streamed = events(h, {"input": "Hello"})
    names = [name for name, _ in streamed]
    assert names == [payload["type"] for _, payload in streamed]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [p["sequence_number"] for _, p in streamed] == list(range(len(streamed)))
    text = "".join(p["delta"] for name, p in streamed if name == "response.output_text.delta")
    final = streamed[-1][1]["response"]
    assert (
        text == final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    )
    assert final["usage"] == whole["usage"] and final["status"] == "completed"
    assert streamed[0][1]["response"]["status"] == "in_progress"
    assert h.http.get(f"/v1/responses/{final['id']}").json()["id"] == final["id"]


def test_openai_stream_helper(h: Harness) -> None:
    with client(h).responses.stream(model=MODEL, input="Hello") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.output_text.endswith(" hello world")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "web_search_call"}]}, 400, "input[0].type"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, 400, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id"),
        ({"input": "x", "previous_response_id": "resp_x"}, 400, "previous_response_id"),
        ({"input": "x" * 200}, 400, "prompt"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.name"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, 400, "tools[0]"),
        ({"input": "x", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_input_gets_a_4xx_in_openai_shape(
    h: Harness, body: dict[str, Any], status: int, param: str
) -> None:
    for stream in (False, True):
        r = h.post("/v1/responses", {**body, "stream": stream})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"]


def test_the_route_needs_the_api_key(own: Callable[..., Harness]) -> None:
    h = own(api_key="secret")
    assert h.post("/v1/responses", {"input": "x"}).status_code == 401
    assert h.http.get("/v1/responses/resp_x").status_code == 401
    auth = {"Authorization": "Bearer secret"}
    assert h.post("/v1/responses", {"input": "x"}, headers=auth).status_code == 200
    assert isinstance(h.http, httpx.Client)


def test_unknown_fields_are_named_and_extras_reach_the_engine(h: Harness) -> None:
    body = {"input": "x", "frobnicate": 1, "include": [], "allowed_token_ids": [7, 8]}
    for stream in (False, True):
        r = h.post("/v1/responses", {**body, "stream": stream})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvflow-ignored-fields"] == "frobnicate,include"
        assert h.fake.added[-1].sampling_params.allowed_token_ids == [7, 8]
    assert "x-kvflow-ignored-fields" not in h.post("/v1/responses", {"input": "x"}).headers

"""HTTP details and limits of the frontend, against the fake engine of
test_frontend_app.py over real sockets and a real uvicorn server: bodies that are not
UTF-8 or nest too deep, the schema's promises, 405 `Allow`, 401 `WWW-Authenticate`,
the Bearer scheme in any case, the engine's load refusals as 429/503 with Retry-After,
and a request's own timeout (408, the request aborted)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_frontend_app import MODEL, Harness, sse_events, start_harness

from kvflow.services.frontend.json_limits import MAX_JSON_DEPTH, json_depth

BODY_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
MESSAGES = [{"role": "user", "content": "hi"}]


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


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return dict(error)


# --- bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_invalid_utf8_is_400_on_every_route(h: Harness, path: str) -> None:
    before = len(h.fake.added)
    body = b'{"prompt":"hi \xff there","max_tokens":4}'
    r = h.http.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_error(r, 400)
    assert "UTF-8" in error["message"] and error["type"] == "invalid_request_error"
    assert len(h.fake.added) == before


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_deep_nesting_under_an_unknown_field_is_400_naming_the_limit(h: Harness, path: str) -> None:
    deep = b'{"extra": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b', "prompt": "x"}'
    r = h.http.post(path, content=deep, headers={"content-type": "application/json"})
    error = assert_error(r, 400)
    assert "1001 levels" in error["message"] and str(MAX_JSON_DEPTH) in error["message"]
    arrays = b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = h.http.post(path, content=arrays, headers={"content-type": "application/json"})
    assert "levels deep" in assert_error(r, 400)["message"]


def test_nesting_up_to_the_limit_is_decoded(h: Harness) -> None:
    extra = b'{"a": ' * (MAX_JSON_DEPTH - 1) + b"1" + b"}" * (MAX_JSON_DEPTH - 1)
    body = b'{"prompt": "x", "max_tokens": 2, "extra": ' + extra + b"}"
    assert json_depth(body) == MAX_JSON_DEPTH
    r = h.http.post("/v1/completions", content=body)
    assert r.status_code == 200, r.text


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth(b'{"a": "[[[{{{", "b": ["\\"[["]}') == 2
    assert json_depth(b'"[[["') == 0 and json_depth(b"7") == 0
    assert json_depth(b"[[1], [[2]]]") == 3


def _reference_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    return 0


@pytest.mark.parametrize(
    "value",
    [
        {"a": "x\\", "b": [["]"]]},  # an escaped backslash ends right before the quote
        {"a": '\\"[[', "b": [{"c": "\\"}]},
        ["\u005b[", {'k"[': [[[]]]}],
        {"url": "data:image/png;base64," + "A/+9" * 50_000, "n": [[1]]},
    ],
)
def test_json_depth_matches_the_parsed_nesting(value: object) -> None:
    body = json.dumps(value).encode()
    assert json_depth(body) == _reference_depth(value)


BAD = [
    ("/tokenize", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [""]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [[]]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop[0]"),
    ("/v1/completions", {"prompt": "x", "timeout": 0}, "timeout"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[...]"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_k": -2}, "top_k"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_what_the_schema_forbids_is_400(h: Harness, path: str, body: Any, param: str) -> None:
    before = len(h.fake.added)
    assert assert_error(h.post(path, body), 400, param)["type"] == "invalid_request_error"
    assert len(h.fake.added) == before


# --- the schema says what the server checks ---------------------------------------------


def test_openapi_states_the_checked_limits(h: Harness) -> None:
    schemas = h.http.get("/openapi.json").json()["components"]["schemas"]
    message = schemas["ChatMessage"]["properties"]
    assert set(message["role"]["enum"]) == {"system", "developer", "user", "assistant", "tool"}
    for request in ("ChatCompletionRequest", "TokenizeRequest"):
        messages = schemas[request]["properties"]["messages"]
        options = messages.get("anyOf", [messages])
        assert [o["minItems"] for o in options if o.get("type") == "array"] == [1]
    chat = schemas["ChatCompletionRequest"]["properties"]
    completion = schemas["CompletionRequest"]["properties"]
    for props, name in [(chat, "max_tokens"), (chat, "max_completion_tokens")]:
        assert _bounds(props[name]) == {"minimum": 1, "maximum": 2**31 - 1}
    assert _bounds(completion["max_tokens"])["minimum"] == 1
    prompt = completion["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt
    listed = next(p for p in prompt if p.get("type") == "array")
    assert listed["minItems"] == 1
    assert _bounds(chat["temperature"]) == {"minimum": 0}
    assert _bounds(chat["top_p"]) == {"exclusiveMinimum": 0, "maximum": 1}
    assert _bounds(chat["presence_penalty"]) == {"minimum": -2, "maximum": 2}
    assert _bounds(completion["timeout"])["exclusiveMinimum"] == 0


def _bounds(prop: dict[str, Any]) -> dict[str, Any]:
    """The numeric bounds of a (nullable) property's non-null branch."""
    branch = next(p for p in prop.get("anyOf", [prop]) if p.get("type") != "null")
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    return {k: branch[k] for k in keys if k in branch}


# --- small HTTP points ------------------------------------------------------------------


def test_405_names_the_allowed_methods(h: Harness) -> None:
    r = h.http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["allow"] == "POST"
    r = h.http.delete("/health")
    assert r.status_code == 405
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}


def test_401_challenges_and_the_scheme_is_case_insensitive(own: Callable[..., Harness]) -> None:
    h = own(api_key="s3cret")
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}]:
        r = h.post("/v1/completions", {"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == "invalid_api_key"
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = h.post(
            "/v1/completions", {"prompt": "x"}, headers={"Authorization": f"{scheme} s3cret"}
        )
        assert r.status_code == 200, (scheme, r.text)
    assert h.http.get("/v1/models", headers={"Authorization": "Bearer  s3cret"}).status_code == 200


# --- load refusals from the engine --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [("queue_full", 429, "rate_limit_error"), ("queue_timeout", 503, "service_unavailable")],
)
def test_engine_refusals_are_the_status_with_retry_after(
    own: Callable[..., Harness], stream: bool, code: str, status: int, error_type: str
) -> None:
    h = own()
    h.fake.refusal = (code, f"refused: {code}")
    body = {"prompt": "x", "max_tokens": 2, "stream": stream}
    r = h.post("/v1/completions", body)
    assert r.status_code == status, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"] == {
        "message": f"refused: {code}",
        "type": error_type,
        "param": None,
        "code": code,
    }
    chat = h.post("/v1/chat/completions", {"messages": MESSAGES, "stream": stream})
    assert chat.status_code == status
    assert _rejected(h) == {"queue_full": 0, "queue_timeout": 0, "timeout": 0, code: 2}


def test_openai_client_sees_rate_limit_error(own: Callable[..., Harness]) -> None:
    h = own()
    h.fake.refusal = ("queue_full", "too many waiting")
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)


def _rejected(h: Harness) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = h.http.get("/metrics").text
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvflow:requests_rejected"
        for s in f.samples
        if s.name.endswith("_total")
    }


# --- a request's own timeout --------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_body_timeout_aborts_a_request_stuck_in_the_queue(
    own: Callable[..., Harness], stream: bool
) -> None:
    h = own()
    assert _rejected(h) == {"queue_full": 0, "queue_timeout": 0, "timeout": 0}
    h.fake.silent = True
    start = time.monotonic()
    r = h.post("/v1/completions", {"prompt": "x", "timeout": 0.3, "stream": stream})
    took = time.monotonic() - start
    error = assert_error(r, 408, "timeout")
    assert error["code"] == "timeout" and "0.3 s" in error["message"]
    assert 0.3 <= took < 5.0
    h.fake.wait_for(lambda: h.fake.added[-1].req_id in h.fake.aborted)
    assert h.client.num_in_flight == 0
    assert _rejected(h)["timeout"] == 1


def test_body_timeout_mid_stream_is_an_error_event_and_aborts(h: Harness) -> None:
    body = {"prompt": "hang on", "timeout": 0.3, "stream": True, "max_tokens": 5}
    with h.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[0]["choices"][0]["text"]  # the one piece the fake sends
    assert events[-2]["error"]["code"] == 408 and events[-1] == "[DONE]"
    h.fake.wait_for(lambda: h.fake.added[-1].req_id in h.fake.aborted)


def test_openai_client_timeout_header_bounds_a_non_streamed_request(
    own: Callable[..., Harness],
) -> None:
    h = own()
    h.fake.silent = True
    r = h.post("/v1/completions", {"prompt": "x"}, headers={"X-Stainless-Read-Timeout": "0.3"})
    assert assert_error(r, 408, "timeout")["code"] == "timeout"
    h.fake.wait_for(lambda: h.fake.added[-1].req_id in h.fake.aborted)
    # The openai client sends its own timeout in that header.
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=60)
    h.fake.silent = False
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
    bad = h.post("/v1/completions", {"prompt": "x"}, headers={"X-Stainless-Read-Timeout": "x"})
    assert bad.status_code == 400


def test_a_stream_starts_once_the_first_delta_is_there(h: Harness) -> None:
    events = []
    with h.http.stream(
        "POST", "/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
    ) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])


def test_timeout_header_bounds_the_wait_for_a_streams_first_chunk(
    own: Callable[..., Harness],
) -> None:
    h = own()
    h.fake.silent = True
    request = {"prompt": "x", "stream": True}
    r = h.post("/v1/completions", request, headers={"X-Stainless-Read-Timeout": "0.3"})
    assert assert_error(r, 408, "timeout")["code"] == "timeout"
    h.fake.wait_for(lambda: h.fake.added[-1].req_id in h.fake.aborted)
    assert h.client.num_in_flight == 0 and _rejected(h)["timeout"] == 1
    # Once a stream has started, the read timeout no longer applies (chunks keep coming).
    h.fake.silent = False
    headers = {"X-Stainless-Read-Timeout": "0.3"}
    with h.http.stream("POST", "/v1/completions", json=request, headers=headers) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])

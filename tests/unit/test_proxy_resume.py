"""The P/D proxy resumes a stream whose decode instance died after the client had some of
it (services/proxy/resume.py, decode_send.py): the SSE record's parsing, stripping and
rewriting, and the app against fake instances (httpx.MockTransport), no network."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvflow.cluster_secret import ClusterSecret
from kvflow.services.proxy.app import build_app
from kvflow.services.proxy.pairing import InstancePools
from kvflow.services.proxy.resend import ResendPolicy
from kvflow.services.proxy.resume import StreamRecord, num_choices, resumable

SECRET = ClusterSecret(b"cluster secret of thirty-two bytes")
FAST = ResendPolicy(max_resends=2, wait_s=5.0, backoff_s=0.01, max_backoff_s=0.02)


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _text(stream_id: str, text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return _event({"id": stream_id, "created": 7 if stream_id == "a" else 9, "choices": [choice]})


def _events(body: str) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for event in body.split("\n\n"):
        if event:
            data = event.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_the_record_keeps_the_ids_and_relays_whole_events_without_them() -> None:
    record = StreamRecord(client_wants_ids=False, num_choices=1)
    first = _text("a", " Hi", [5, 6])
    assert record.relay(first[:20]) == b""  # half an event: the client waits for the rest
    relayed = record.relay(first[20:] + _text("a", " there", [7])[:10])
    assert _events(relayed.decode()) == [
        {"id": "a", "created": 7, "choices": [{"index": 0, "text": " Hi", "finish_reason": None}]}
    ]
    assert record.token_ids == {0: [5, 6]} and not record.done
    # " there" never reached the client: not resumed from
    assert record.broke() == [{"index": 0, "token_ids": [5, 6], "finished": False}]
    # A resumed stream's chunk: the first stream's id and created, its own text.
    resumed = _text("b", " again", [8], "length")
    assert _events(record.relay(resumed).decode())[0] == {
        "id": "a", "created": 7,
        "choices": [{"index": 0, "text": " again", "finish_reason": "length"}],
    }  # fmt: skip
    assert record.token_ids == {0: [5, 6, 8]} and record.done
    error = b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n'
    assert record.relay(error) == error  # the decode frontend's own error, as it is


def test_a_client_that_asked_for_ids_keeps_them() -> None:
    record = StreamRecord(client_wants_ids=True, num_choices=1)
    chunk = {"id": "a", "created": 1, "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "text": "x", "token_ids": [3]}]}  # fmt: skip
    assert _events(record.relay(_event(chunk)).decode()) == [chunk]
    assert record.token_ids == {0: [3]}


@pytest.mark.parametrize(
    "body, resumed, choices",
    [
        ({"prompt": "x", "stream": True}, True, 1),
        ({"prompt": [1, 2, 3], "stream": True, "n": 1}, True, 1),
        ({"prompt": ["one"], "stream": True}, True, 1),
        ({"messages": [], "stream": True, "n": 3}, True, 3),
        ({"prompt": "x", "stream": True, "n": 2}, True, 2),
        ({"prompt": ["one", "two"], "stream": True, "n": 2}, True, 4),
        ({"prompt": [[1, 2], [3]], "stream": True}, True, 2),
        ({"prompt": "x"}, False, 1),  # not streamed: resent whole, never resumed
        ({"prompt": "x", "stream": True, "use_beam_search": True}, False, 1),
    ],
)
def test_what_can_be_resumed(body: dict[str, Any], resumed: bool, choices: int) -> None:
    assert resumable(body, SECRET) is resumed
    assert resumable(body, None) is False  # no secret, nothing to sign the tokens with
    assert num_choices(body) == choices


def test_each_choice_is_recorded_and_a_finished_one_is_marked() -> None:
    record = StreamRecord(client_wants_ids=False, num_choices=2)
    both = {"id": "a", "created": 1, "choices": [
        {"index": 1, "text": "b", "token_ids": [4], "finish_reason": "stop"},
        {"index": 0, "text": "a", "token_ids": [3], "finish_reason": None},
    ]}  # fmt: skip
    record.relay(_event(both) + _text("a", "c", [5]))
    assert not record.done
    assert record.broke() == [
        {"index": 0, "token_ids": [3, 5], "finished": False},
        {"index": 1, "token_ids": [4], "finished": True},
    ]


class _Stream(httpx.AsyncByteStream):
    """An SSE body; `breaks`: the instance dies after the chunks."""

    def __init__(self, chunks: list[bytes], breaks: bool) -> None:
        self.chunks, self.breaks = chunks, breaks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.ReadError("connection reset by peer")


Decode = Callable[[dict[str, Any], int], httpx.Response]


def _serve(decode: Decode, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str]:
    """One client request through a proxy with a cluster secret: the client's body text,
    the decode requests in order, and /metrics."""
    sent: list[dict[str, Any]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p0":
            return httpx.Response(200, json={"choices": []})
        sent.append(json.loads(request.content))
        return decode(sent[-1], len(sent))

    pools = InstancePools(["http://p0"], ["http://d0", "http://d1"])
    app = build_app(pools, secret=SECRET, policy=FAST, transport=httpx.MockTransport(upstream))

    async def go() -> tuple[str, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200
            return response.text, (await client.get("/metrics")).text

    text, metrics = asyncio.run(go())
    return text, sent, metrics


def test_a_broken_stream_goes_on_from_its_tokens_elsewhere_as_one_stream() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        if n == 1:  # dies after two tokens
            chunks = [_text("a", " Hi", [5]), _text("a", " there", [6])]
            return httpx.Response(200, stream=_Stream(chunks, breaks=True))
        resume = request["kv_resume"]
        assert resume["choices"] == [{"index": 0, "token_ids": [5, 6], "finished": False}]
        assert request["return_token_ids"] is True
        signed = [(c["index"], c["finished"], c["token_ids"]) for c in resume["choices"]]
        assert SECRET.check_resume(
            resume["request_id"], resume["expires_at"], signed, resume["signature"]
        ) is None  # fmt: skip
        chunks = [_text("b", ",", [7]), _text("b", " you", [8], "length"), b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=_Stream(chunks, breaks=False))

    body = {"prompt": "x", "stream": True, "max_tokens": 4, "kv_resume": {"choices": []}}
    text, sent, metrics = _serve(decode, body)
    events = _events(text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " Hi there, you"
    assert {(c["id"], c["created"]) for c in chunks} == {("a", 7)}
    assert not any("token_ids" in c["choices"][0] for c in chunks)
    assert "kv_resume" not in sent[0]  # the client's own is dropped
    assert [r["return_token_ids"] for r in sent] == [True, True]
    assert "kvflow:proxy_stream_resumes_total 1" in metrics
    assert "kvflow:proxy_broken_streams_total 0" in metrics


def test_resumes_share_the_resend_budget_then_the_stream_ends_in_an_error() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        choices = request.get("kv_resume", {}).get("choices", [{"token_ids": []}])
        ids = choices[0]["token_ids"]
        return httpx.Response(200, stream=_Stream([_text("a", "t", [len(ids)])], breaks=True))

    text, sent, metrics = _serve(decode, {"prompt": "x", "stream": True})
    assert len(sent) == 1 + FAST.max_resends
    resumed = [r["kv_resume"]["choices"][0]["token_ids"] for r in sent[1:]]
    assert "kv_resume" not in sent[0] and resumed == [[0], [0, 1]]
    events = _events(text)
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and "failed during the stream" in error["error"]["message"]
    assert "kvflow:proxy_stream_resumes_total 2" in metrics
    assert "kvflow:proxy_broken_streams_total 1" in metrics


def test_a_finished_choice_is_not_resumed() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        chunks = [_text("a", " Hi", [5], "stop")]  # dies before its [DONE]
        return httpx.Response(200, stream=_Stream(chunks, breaks=True))

    text, sent, _ = _serve(decode, {"prompt": "x", "stream": True})
    assert len(sent) == 1 and _events(text)[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in _events(text))


def test_a_resume_the_decode_instance_refuses_ends_in_an_error() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        if n == 1:
            return httpx.Response(200, stream=_Stream([_text("a", " Hi", [5])], breaks=True))
        return httpx.Response(400, json={"error": {"message": "kv_resume needs a secret"}})

    text, sent, metrics = _serve(decode, {"prompt": "x", "stream": True})
    assert len(sent) == 2
    error = _events(text)[-2]
    assert isinstance(error, dict) and "resuming it failed (400)" in error["error"]["message"]
    assert "kvflow:proxy_broken_streams_total 1" in metrics


def test_a_stream_that_broke_inside_its_first_event_is_sent_again_as_it_was() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        if n == 1:  # the status line and half an event: the client has no chunk
            return httpx.Response(200, stream=_Stream([_text("a", " Hi", [5])[:15]], True))
        assert "kv_resume" not in request
        chunks = [_text("b", " Hi", [5], "length"), b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=_Stream(chunks, breaks=False))

    text, sent, metrics = _serve(decode, {"prompt": "x", "stream": True})
    events = _events(text)
    assert len(sent) == 2 and len(events) == 2 and events[-1] == "[DONE]"
    assert isinstance(events[0], dict) and events[0]["id"] == "b"
    assert events[0]["choices"][0]["text"] == " Hi"
    assert "kvflow:proxy_stream_resumes_total 1" in metrics


def test_with_two_choices_only_the_unfinished_one_goes_on() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        if n == 1:  # choice 1 finished, choice 0 had one token, then the instance died
            both = {"id": "a", "created": 7, "choices": [
                {"index": 1, "text": "B", "token_ids": [4], "finish_reason": "stop"},
                {"index": 0, "text": "A", "token_ids": [3], "finish_reason": None},
            ]}  # fmt: skip
            return httpx.Response(200, stream=_Stream([_event(both)], breaks=True))
        assert request["kv_resume"]["choices"] == [
            {"index": 0, "token_ids": [3], "finished": False},
            {"index": 1, "token_ids": [4], "finished": True},
        ]
        chunks = [_text("b", "a", [5], "length"), b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=_Stream(chunks, breaks=False))

    text, sent, metrics = _serve(decode, {"prompt": "x", "stream": True, "n": 2})
    events = _events(text)
    assert len(sent) == 2 and events[-1] == "[DONE]" and len(events) == 3
    texts = {c["index"]: "" for e in events[:-1] for c in e["choices"]}  # type: ignore[index]
    for event in events[:-1]:
        for choice in event["choices"]:  # type: ignore[index]
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "Aa", 1: "B"}
    assert "kvflow:proxy_stream_resumes_total 1" in metrics


def _error(code: int) -> bytes:
    return _event({"error": {"message": "the engine died", "type": "x", "code": code}})


def test_the_decode_instances_own_5xx_error_event_is_resumed_not_relayed() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        if n == 1:  # its engine died: the decode frontend ends the stream with an error
            chunks = [_text("a", " Hi", [5]) + _error(503) + b"data: [DONE]\n\n"]
            return httpx.Response(200, stream=_Stream(chunks, breaks=False))
        assert request["kv_resume"]["choices"][0]["token_ids"] == [5]
        chunks = [_text("b", " you", [6], "length"), b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=_Stream(chunks, breaks=False))

    text, sent, metrics = _serve(decode, {"prompt": "x", "stream": True})
    events = _events(text)
    assert len(sent) == 2 and not any("error" in e for e in events[:-1]), events
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" Hi", " you"]  # type: ignore[index]
    assert 'kvflow:proxy_decode_resends_total{reason="status"} 1' in metrics
    assert "kvflow:proxy_stream_resumes_total 1" in metrics


def test_a_4xx_error_event_is_the_clients() -> None:
    def decode(request: dict[str, Any], n: int) -> httpx.Response:
        chunks = [_text("a", " Hi", [5]) + _error(400) + b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=_Stream(chunks, breaks=False))

    text, sent, metrics = _serve(decode, {"prompt": "x", "stream": True})
    events = _events(text)
    assert len(sent) == 1 and events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "the engine died", "type": "x", "code": 400}}
    assert "kvflow:proxy_stream_resumes_total 0" in metrics

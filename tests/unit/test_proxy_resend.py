"""The P/D proxy resends a request whose decode instance failed it before the client had
any of its answer (services/proxy/resend.py, decode_send.py): the policy's bounds, and
the app against fake instances (httpx.MockTransport), no network."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvflow.services.proxy.app import build_app
from kvflow.services.proxy.pairing import InstancePools
from kvflow.services.proxy.resend import (
    Failure,
    ResendPolicy,
    failure_of_error,
    failure_of_status,
)

ANSWER = {"choices": [{"text": " Paris", "finish_reason": "length"}]}
FAST = ResendPolicy(max_resends=2, wait_s=5.0, backoff_s=0.01, max_backoff_s=0.02)


def test_statuses_and_errors_that_are_resent() -> None:
    assert [failure_of_status(s) for s in (500, 502, 503, 504)] == [Failure.STATUS] * 4
    assert [failure_of_status(s) for s in (200, 400, 404, 422, 429, 501, 505)] == [None] * 7
    request = httpx.Request("POST", "http://decode/v1/completions")
    cases = {
        httpx.ConnectError("refused", request=request): Failure.UNREACHABLE,
        httpx.ConnectTimeout("slow", request=request): Failure.UNREACHABLE,
        httpx.RemoteProtocolError("closed", request=request): Failure.DROPPED,
        httpx.ReadError("reset", request=request): Failure.DROPPED,
        httpx.ReadTimeout("slow", request=request): None,  # alive but slow: not resent
        httpx.PoolTimeout("busy", request=request): None,
    }
    assert {type(e): failure_of_error(e) for e in cases} == {type(e): f for e, f in cases.items()}


def test_policy_bounds_resends_by_count_and_the_wait_by_time() -> None:
    policy = ResendPolicy(max_resends=2, wait_s=10.0, backoff_s=0.5, max_backoff_s=2.0)
    # Backoff doubles per failure, capped.
    pauses = [policy.delay(Failure.UNREACHABLE, n, 0, 0.0) for n in range(1, 6)]
    assert pauses == [0.5, 1.0, 2.0, 2.0, 2.0]
    # Refused connections: only the time bounds them.
    assert policy.delay(Failure.UNREACHABLE, 40, 0, 7.9) == 2.0
    assert policy.delay(Failure.UNREACHABLE, 40, 0, 8.1) is None
    # Dropped or 5xx: at most max_resends resends, and the same time bound.
    assert policy.delay(Failure.DROPPED, 2, 2, 0.0) == 1.0
    assert policy.delay(Failure.STATUS, 3, 3, 0.0) is None
    assert policy.delay(Failure.DROPPED, 1, 1, 9.9) is None
    assert ResendPolicy(max_resends=0).delay(Failure.DROPPED, 1, 1, 0.0) is None
    with pytest.raises(ValueError):
        ResendPolicy(max_resends=-1)


class _BrokenStream(httpx.AsyncByteStream):
    """An SSE body whose instance dies after `chunks`."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("connection reset by peer")


Handler = Callable[[httpx.Request, int], httpx.Response]


def _serve(
    decode: Handler,
    body: dict[str, Any],
    decode_urls: tuple[str, ...] = ("http://d0",),
    policy: ResendPolicy = FAST,
    prefill: Handler | None = None,
) -> tuple[httpx.Response, list[str], str]:
    """One client request through the proxy: its response, the upstream calls in order
    (host, and "p0+" for a prefill instance asked the whole request), and /metrics."""
    calls: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        whole = host == "p0" and json.loads(request.content).get("max_tokens") != 1
        calls.append(host + "+" if whole else host)
        if host != "p0":
            return decode(request, sum(c.startswith("d") for c in calls))
        if prefill is not None:
            return prefill(request, calls.count("p0+"))
        return httpx.Response(200, json=ANSWER)

    pools = InstancePools(["http://p0"], list(decode_urls))
    app = build_app(pools, policy=policy, transport=httpx.MockTransport(upstream))

    async def go() -> tuple[httpx.Response, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            response = await client.post("/v1/completions", json=body)
            metrics = (await client.get("/metrics")).text
        return response, metrics

    response, metrics = asyncio.run(go())
    return response, calls, metrics


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_a_dropped_request_is_prefilled_and_decoded_again() -> None:
    def decode(request: httpx.Request, n: int) -> httpx.Response:
        if n == 1:
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        if n == 2:
            return _refused(request)  # restarting
        return httpx.Response(200, json=ANSWER)

    no_fallback = dataclasses.replace(FAST, prefill_fallback=False)
    response, calls, metrics = _serve(decode, {"prompt": "x", "max_tokens": 8}, policy=no_fallback)
    assert response.status_code == 200 and response.json() == ANSWER
    assert calls == ["p0", "d0"] * 3  # every send prefills again
    assert 'kvflow:proxy_decode_resends_total{reason="dropped"} 1' in metrics
    assert 'kvflow:proxy_decode_resends_total{reason="unreachable"} 1' in metrics


def test_a_5xx_goes_to_another_decode_instance_and_a_4xx_is_never_resent() -> None:
    def decode(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(500 if request.url.host == "d0" else 200, json=ANSWER)

    response, calls, _ = _serve(decode, {"prompt": "x"}, ("http://d0", "http://d1"))
    assert response.status_code == 200
    assert calls == ["p0", "d0", "p0", "d1"]

    def bad(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "max_tokens"}})

    response, calls, metrics = _serve(bad, {"prompt": "x"})
    assert response.status_code == 400 and calls == ["p0", "d0"]
    assert 'reason="status"} 0' in metrics


def test_resends_are_bounded_and_the_last_failure_is_answered() -> None:
    def dying(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "recovering"}})

    response, calls, metrics = _serve(dying, {"prompt": "x"})
    assert response.status_code == 503 and response.json()["error"]["message"] == "recovering"
    assert calls.count("d0") == 1 + FAST.max_resends
    assert "kvflow:proxy_decode_gave_up_total 1" in metrics

    short = ResendPolicy(wait_s=0.3, backoff_s=0.01, max_backoff_s=0.05)
    nobody = lambda r, n: _refused(r)  # noqa: E731
    response, calls, _ = _serve(nobody, {"prompt": "x"}, policy=short, prefill=nobody)
    assert response.status_code == 503  # nobody took it within wait_s
    assert 2 < calls.count("d0") < 30 and calls.count("p0+") == calls.count("d0")
    assert "no instance completed the request" in response.json()["error"]["message"]


def test_when_every_decode_instance_refuses_a_prefill_instance_serves_it_whole() -> None:
    def decode(request: httpx.Request, n: int) -> httpx.Response:
        return _refused(request) if n <= 2 else httpx.Response(200, json=ANSWER)

    body = {"prompt": "x", "max_tokens": 8, "kv_transfer_params": {"remote_address": "evil"}}
    response, calls, metrics = _serve(decode, body, ("http://d0", "http://d1"))
    assert response.status_code == 200
    assert calls == ["p0", "d0", "p0", "d1", "p0+"]  # both refused: p0 serves it
    assert "kvflow:proxy_prefill_fallbacks_total 1" in metrics

    # The prefill instance down too: back to waiting for a decode instance.
    def prefill(request: httpx.Request, whole: int) -> httpx.Response:
        return _refused(request)

    response, calls, _ = _serve(decode, body, prefill=prefill)
    assert response.status_code == 200
    assert calls == ["p0", "d0", "p0+"] * 2 + ["p0", "d0"]  # decode, whole prefill in turn


def test_a_stream_is_resent_before_its_first_chunk_and_ends_in_an_error_after() -> None:
    event = b'data: {"choices": [{"text": " Paris"}]}\n\n'

    def decode(request: httpx.Request, n: int) -> httpx.Response:
        if n == 1:  # died before the first token
            return httpx.Response(200, stream=_BrokenStream([]))
        return httpx.Response(200, stream=_BrokenStream([event]))  # died after it

    response, calls, metrics = _serve(decode, {"prompt": "x", "stream": True})
    assert response.status_code == 200 and calls.count("d0") == 2
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == event.decode().strip()
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "the decode instance failed during the stream" in error["message"]
    assert events[2] == "data: [DONE]"
    assert "kvflow:proxy_broken_streams_total 1" in metrics


def test_models_asks_the_instances_in_turn() -> None:
    """/v1/models: the first instance that answers; a down one does not fail it, and
    none answering is a 503."""
    listing = {"object": "list", "data": [{"id": "m"}]}
    down: set[str] = set()

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            return _refused(request)
        return httpx.Response(200, json={**listing, "from": request.url.host})

    pools = InstancePools(["http://p0"], ["http://d0", "http://d1"])
    app = build_app(pools, policy=FAST, transport=httpx.MockTransport(upstream))

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.get("/v1/models")

    answered = []
    for hosts in [set(), {"d0"}, {"d0", "d1"}, {"d0", "d1", "p0"}]:
        down.clear()
        down.update(hosts)
        response = asyncio.run(ask())
        answered.append((response.status_code, response.json().get("from")))
    assert answered == [(200, "d0"), (200, "d1"), (200, "p0"), (503, None)]

"""Load shedding under a real `kvflow serve` (tiny random model): a burst beyond
--max-waiting-requests gets 429 with Retry-After while the admitted requests return
their exact token counts; a request stuck behind running ones past --max-queue-delay
gets 503 (streamed or not); a request's own `timeout` ends it with 408 and frees its KV
blocks. The rejection counters match what the clients saw."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    Server,
    metric_values,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 2
MAX_WAITING = 4
# Requests of LONG tokens hold their seats for at least ~0.5 s even on a fast machine
# (~1 ms a step at best for this model), 5x the queue delay; seconds on a slow one.
QUEUE_DELAY_S = 0.1
BURST = 48
LONG = 480


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("limited"),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-waiting-requests",
        str(MAX_WAITING),
        "--max-queue-delay",
        str(QUEUE_DELAY_S),
        "--num-threads",
        "1",  # see test_api_robustness.py: far faster on 2 shared cores
    )
    yield server
    code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()


def body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        **extra,
    }


def rejected_by_reason(server: Server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=5.0).text
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvflow:requests_rejected"
        for s in f.samples
        if s.name.endswith("_total")
    }


def engine_idle(server: Server) -> bool:
    values = metric_values(server.base_url)
    return (
        values["kvflow:kv_cache_usage_perc"] == 0.0
        and values["kvflow:num_requests_running"] == 0.0
        and values["kvflow:num_requests_waiting"] == 0.0
    )


def test_counters_exist_at_zero(limited: Server) -> None:
    assert rejected_by_reason(limited) == {"queue_full": 0, "queue_timeout": 0, "timeout": 0}


def test_burst_beyond_the_waiting_limit_gets_429(limited: Server) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        stream = i % 2 == 1
        request = body(f"request {i}", 16, stream=stream)
        return await client.post(limited.base_url + "/v1/completions", json=request)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=BURST)
        async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(BURST)))

    before = rejected_by_reason(limited)
    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for i, r in enumerate(responses):
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        elif r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_timeout"
        elif i % 2 == 0:
            assert r.json()["usage"]["completion_tokens"] == 16
        else:
            events = list(sse_events(r))
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    after = rejected_by_reason(limited)
    assert after["queue_full"] - before["queue_full"] == statuses.count(429)
    assert after["queue_timeout"] - before["queue_timeout"] == statuses.count(503)
    assert wait_for(lambda: engine_idle(limited), 10.0)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": MAX_WAITING + 1}, "n"),
        ({"prompt": [f"p{i}" for i in range(MAX_WAITING + 1)]}, "prompt"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
    ],
)
def test_more_samples_than_may_wait_is_a_400_not_a_429_forever(
    limited: Server, extra: dict[str, Any], param: str
) -> None:
    """An idle engine refused these with a 429 on every retry: now a 400 that says why."""
    assert wait_for(lambda: engine_idle(limited), 10.0)
    before = rejected_by_reason(limited)
    for stream in (False, True):
        r = httpx.post(
            limited.base_url + "/v1/completions",
            json={**body("many", 4, stream=stream), **extra},
            timeout=60.0,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        assert f"max waiting requests ({MAX_WAITING})" in error["message"], error
    assert rejected_by_reason(limited) == before  # the engine never saw them
    ok = httpx.post(
        limited.base_url + "/v1/completions", json={**body("ok", 2), "n": MAX_WAITING}, timeout=60
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_WAITING, ok.text


def test_queue_delay_fails_waiting_requests_with_503(limited: Server) -> None:
    url = limited.base_url + "/v1/completions"
    with httpx.Client(timeout=120.0) as client:
        blockers = [
            client.stream("POST", url, json=body(f"blocker {i}", LONG, stream=True))
            for i in range(MAX_NUM_SEQS)
        ]
        opened = [b.__enter__() for b in blockers]
        try:
            # Both seats are taken once each has streamed a chunk. (The iterators are
            # kept: a dropped one would close its connection, which aborts the request.)
            streams = [sse_events(response) for response in opened]
            for response, events in zip(opened, streams):
                assert response.status_code == 200
                assert next(events)["choices"]
            before = rejected_by_reason(limited)
            for stream in (False, True):
                start = time.monotonic()
                r = client.post(url, json=body("late", 4, stream=stream))
                waited = time.monotonic() - start
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("service_unavailable", "queue_timeout")
                assert "max_queue_delay" in error["message"]
                assert waited >= QUEUE_DELAY_S
            after = rejected_by_reason(limited)
            assert after["queue_timeout"] - before["queue_timeout"] == 2
        finally:
            for blocker in blockers:
                blocker.__exit__(None, None, None)  # disconnects: aborted
    assert wait_for(lambda: engine_idle(limited), 10.0)


def stream_with_timeout(server: Server, timeout: float) -> tuple[int, list[Any]]:
    url = server.base_url + "/v1/completions"
    request = body("slow", LONG, stream=True, timeout=timeout)
    with (
        httpx.Client(timeout=120.0) as client,
        client.stream("POST", url, json=request) as response,
    ):
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        return 200, list(sse_events(response))


def test_request_timeout_aborts_and_frees_kv_blocks(limited: Server) -> None:
    url = limited.base_url + "/v1/completions"
    before = rejected_by_reason(limited)
    # A deadline that passes mid-stream: this machine's speed varies (a shared CI host),
    # so halve or double it until one does.
    timeout, timed_out = 0.2, 0
    for _ in range(8):
        status, events = stream_with_timeout(limited, timeout)
        finished = status == 200 and "error" not in events[-2]
        timed_out += not finished
        if status == 200 and not finished:
            break
        timeout = timeout / 4 if finished else timeout * 2
    else:
        pytest.fail("no timeout passed mid-stream")
    texts = [e for e in events[:-1] if "choices" in e]
    assert texts, "tokens were streamed before the timeout"
    assert texts[-1]["choices"][0]["finish_reason"] is None
    error = events[-2]["error"]
    assert (error["code"], error["type"]) == (408, "timeout_error")
    assert f"{timeout:g} s" in error["message"] and events[-1] == "[DONE]"
    r = httpx.post(url, json=body("slow", LONG, timeout=0.001), timeout=120.0)
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
    after = rejected_by_reason(limited)
    assert after["timeout"] - before["timeout"] == timed_out + 1
    assert wait_for(lambda: engine_idle(limited), 10.0)
    # The engine is whole: a fresh request gets its exact token count.
    fresh = httpx.post(url, json=body("fresh", 12), timeout=120.0).json()
    assert fresh["usage"]["completion_tokens"] == 12

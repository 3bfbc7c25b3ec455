"""The frontend's side of a resumed P/D stream (kv_resume), against the fake engine of
test_frontend_app.py over real sockets: only the proxy's signed tokens pass (anything
else is an OpenAI 400, counted), and they reach the engine as the request's output so
far; the stream goes on without a second role chunk, its usage counting them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_frontend_app import MODEL, Harness, sse_events, start_harness

from kvflow.cluster_secret import SECRET_FILE_ENV, ClusterSecret
from kvflow.services.proxy.resume import signed_resume

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = start_harness(tmp_path_factory.mktemp("ipc"))
    yield harness
    harness.stop()


def _signed(token_ids: list[int], *more: tuple[int, list[int], bool]) -> dict[str, Any]:
    """kv_resume as the proxy signs it: choice 0 unfinished with `token_ids`, and `more`
    choices as (index, token ids, finished)."""
    secret = ClusterSecret.read(os.environ[SECRET_FILE_ENV])  # the tests' (conftest.py)
    choices = [{"index": 0, "token_ids": token_ids, "finished": False}]
    choices += [{"index": i, "token_ids": t, "finished": f} for i, t, f in more]
    return signed_resume(secret, choices, time.time())


def _rejected(h: Harness) -> float:
    text = h.http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("kvflow:kv_transfer_params_rej"))
    return float(line.split()[-1])


def _bad(case: str) -> dict[str, Any]:
    if case == "unsigned":
        return {"kv_resume": {"choices": [{"index": 0, "token_ids": [7, 8]}]}}
    if case == "tampered":
        signed = _signed([7, 8])
        signed["choices"][0]["token_ids"] = [7, 9]
        return {"kv_resume": signed}
    if case == "forged":
        forged = {"signature": "00", "request_id": "r", "expires_at": time.time() + 60}
        return {"kv_resume": {"choices": [{"index": 0, "token_ids": [7]}], **forged}}
    if case == "no-such-choice":
        return {"kv_resume": _signed([7], (1, [8], False))}  # the request has n=1
    return {"stream": False}  # a resume is a stream's


@pytest.mark.parametrize("case", ["unsigned", "tampered", "forged", "no-such-choice", "whole"])
def test_anything_but_the_proxys_resume_is_a_400(h: Harness, case: str) -> None:
    before, added = _rejected(h), len(h.fake.added)
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "kv_resume": _signed([7])}
    body.update(_bad(case))
    r = h.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_resume" and error["type"] == "invalid_request_error"
    assert len(h.fake.added) == added, "a refused request must not reach the engine"
    refused = case in ("unsigned", "tampered", "forged")  # (the others were signed)
    assert _rejected(h) == before + refused


def test_a_signed_resume_goes_on_from_its_tokens(h: Harness) -> None:
    added = len(h.fake.added)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "prompt_logprobs": 1,
            "kv_resume": _signed([7, 8])}  # fmt: skip
    with h.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    (add,) = h.fake.added[added:]
    assert add.output_token_ids == [7, 8]
    assert add.sampling_params.prompt_logprobs is None  # sent with the first stream
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    assert not any("role" in d for d in deltas)  # the client has the first stream's
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 2 + 3  # the fake's three pieces after the two


def test_with_two_choices_the_finished_one_is_not_generated_again(h: Harness) -> None:
    added = len(h.fake.added)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True, "n": 2,
            "stream_options": {"include_usage": True},
            "kv_resume": _signed([7, 8], (1, [9], True))}  # fmt: skip
    with h.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    (add,) = h.fake.added[added:]  # choice 1 finished: only choice 0 goes to the engine
    assert add.req_id.endswith("#0") and add.output_token_ids == [7, 8]
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert {c["index"] for c in choices} == {0} and not any("role" in c["delta"] for c in choices)
    assert events[-2]["usage"]["completion_tokens"] == 2 + 3 + 1

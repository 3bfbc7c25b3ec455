"""A request with more samples than an engine lets wait (--max-waiting-requests) is a
400 that says why, decided in the frontend before anything reaches the engine: an idle
engine would refuse it with a 429 on every retry. Against the fake engine of
test_frontend_app.py over real sockets and a real uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_frontend_app import MODEL, Harness, start_harness

MAX_WAITING = 3
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = start_harness(tmp_path_factory.mktemp("ipc"), max_waiting_requests=MAX_WAITING)
    yield harness
    harness.stop()


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "a", "n": 4}, "n", "n=4 exceeds"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 4}, "n", "n=4 exceeds"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, "prompt", "2 prompts x n=2"),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "4 prompts x n=1"),
    ],
)
def test_more_samples_than_may_wait_is_a_400(
    h: Harness, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    added = len(h.fake.added)
    for stream in (False, True):
        response = h.post(path, {"model": MODEL, "max_tokens": 2, "stream": stream, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        assert words in error["message"] and "max waiting requests (3)" in error["message"]
    assert len(h.fake.added) == added  # nothing reached the engine


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a", "n": MAX_WAITING}),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": MAX_WAITING}),
        ("/v1/completions", {"prompt": ["a", "b", "c"]}),
    ],
)
def test_as_many_samples_as_may_wait_are_served(
    h: Harness, path: str, body: dict[str, Any]
) -> None:
    response = h.post(path, {"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_WAITING


def test_no_limit_no_check(tmp_path: Path) -> None:
    harness = start_harness(tmp_path)
    try:
        response = harness.post("/v1/completions", {"model": MODEL, "prompt": "a", "n": 8})
        assert response.status_code == 200, response.text
    finally:
        harness.stop()

"""Prefill order `shortest` under a real `kvflow serve` (tiny random model): with one
seat (--max-num-seqs 1) held by a running request, a long prompt queues first and a
short one second; when the seat frees, the short one is admitted first, so it streams
all its tokens before the long one's first token (queue order would do the opposite:
tests/unit/test_prefill_order.py)."""

from __future__ import annotations

import threading
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

BLOCKER_TOKENS = 480  # holds the seat while the other two queue: >= 0.5 s at ~1 ms a step


@pytest.fixture(scope="module")
def shortest_first(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    server = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("prefill_order"),
        "--max-num-seqs",
        "1",
        "--prefill-order",
        "shortest",
        "--num-threads",
        "1",
    )
    yield server
    code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()


class Stream(threading.Thread):
    """One streamed completion; records when its first and last chunks came."""

    def __init__(self, base_url: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body: dict[str, Any] = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        self.url = base_url + "/v1/completions"
        self.first = threading.Event()
        self.first_at = self.last_at = 0.0
        self.num_chunks = 0

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120.0) as response:
            assert response.status_code == 200
            for event in sse_events(response):
                if event == "[DONE]":
                    break
                if event["choices"][0]["text"]:
                    self.num_chunks += 1
                    self.last_at = time.monotonic()
                    if not self.first.is_set():
                        self.first_at = self.last_at
                        self.first.set()


def test_short_prompt_overtakes_a_long_one_queued_before_it(shortest_first: Server) -> None:
    url = shortest_first.base_url
    waiting = "kvflow:num_requests_waiting"
    blocker = Stream(url, "hold the seat", BLOCKER_TOKENS)
    blocker.start()
    assert blocker.first.wait(60.0)
    long = Stream(url, " ".join(["long"] * 300), 4)
    long.start()
    assert wait_for(lambda: metric_values(url)[waiting] == 1.0, 30.0, 0.02)
    short = Stream(url, "short", 4)
    short.start()
    assert wait_for(lambda: metric_values(url)[waiting] == 2.0, 30.0, 0.02)
    assert blocker.is_alive(), "the blocker ended before both queued: raise BLOCKER_TOKENS"
    for stream in (blocker, long, short):
        stream.join(120.0)
    assert long.num_chunks > 0 and short.num_chunks > 0
    # One seat: whichever got it first streams all its tokens before the other starts.
    # First and last chunks compared apart: at the hand-over the two client threads
    # may stamp short's last and long's first chunk in either order (sub-ms).
    assert short.first_at < long.first_at and short.last_at < long.last_at

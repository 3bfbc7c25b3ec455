"""`kvflow serve --tensor-parallel-size 2`: two worker ranks (gloo over TCP on loopback).

Served greedy completions equal the offline TP=1 engine's (chunked prefill, prefix
hits, n > 1, a stop string). Then rank 1 is SIGKILLed during a stream: the stream ends
with an error within seconds, /health turns 503, and `kvflow serve` exits 1 with no
process left behind (a rank is never restarted alone: its peers' group is broken).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    child_pid,
    group_members,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

PREFIX = "In a quiet village by the sea there lived an old fisherman who every morning "
PROMPTS = [PREFIX + "went out", PREFIX + "sang", "Hello"]
MAX_TOKENS = 10
DEADLINE_S = 120.0  # only a deadline for a loaded 2-core machine
FAIL_WITHIN_S = 10.0


def _offline_tp1(model_dir: Path, stop: str | None) -> list[list[str]]:
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", num_threads=1, num_blocks=512,
        max_num_batched_tokens=16,
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, n=2, stop=[stop] if stop else None
    )
    return [[c.text for c in o.outputs] for o in llm.generate(PROMPTS, params)]


def _served(base_url: str, stop: str | None) -> list[list[str]]:
    texts = []
    with httpx.Client(timeout=DEADLINE_S) as http:
        for prompt in PROMPTS:  # in turn: the later ones hit the first one's prefix
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "n": 2,
                "stop": stop,
            }
            response = http.post(base_url + "/v1/completions", json=body)
            assert response.status_code == 200, response.text
            choices = sorted(response.json()["choices"], key=lambda c: c["index"])
            texts.append([c["text"] for c in choices])
    return texts


def _stream_until_error(base_url: str, started: threading.Event) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    errors, tokens = [], 0
    with (
        httpx.Client(timeout=DEADLINE_S) as http,
        http.stream("POST", base_url + "/v1/completions", json=body) as response,
    ):
        for event in sse_events(response):
            if isinstance(event, dict) and "error" in event:
                errors.append(event["error"]["message"])
            elif isinstance(event, dict):
                tokens += 1
                if tokens >= 3:
                    started.set()
    return {"errors": errors, "tokens": tokens, "ended": time.monotonic()}


def test_served_tp2_equals_offline_tp1_and_a_killed_rank_ends_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    probe = _offline_tp1(tiny_model_dir, None)
    stop = probe[2][0][len(probe[2][0]) // 2 :][:3]
    want = _offline_tp1(tiny_model_dir, stop)
    server = start_server(
        tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", "--num-threads", "1",
        "--max-num-batched-tokens", "16",
    )  # fmt: skip
    try:
        got = _served(server.base_url, stop)
        rank1 = child_pid(server.pid, "kvflow-worker1")
        assert rank1 is not None and child_pid(server.pid, "kvflow-worker0") is not None
        saw_503, result, killed_at, code = kill_during_a_stream(server, rank1)
    finally:
        stop_code, survivors = stop_server(server)
    assert got == want
    assert saw_503
    assert result["errors"], result
    # The killed rank, or its peer whose collective broke first: either names a rank.
    assert re.search(r"worker rank [01]", result["errors"][-1]), result["errors"]
    assert result["ended"] - killed_at < FAIL_WITHIN_S
    assert code == stop_code == 1, server.log_tail()
    assert survivors == [] and group_members(server.pid) == [], server.log_tail()


def kill_during_a_stream(server: Any, pid: int) -> tuple[bool, dict[str, Any], float, int]:
    """SIGKILL `pid` (a worker rank) while a stream runs: (whether /health turned 503
    within FAIL_WITHIN_S, the stream's outcome, when the kill was sent, the server's own
    exit code: the engine is dead, so it exits by itself)."""
    started = threading.Event()
    result: dict[str, Any] = {}
    streamer = threading.Thread(
        target=lambda: result.update(_stream_until_error(server.base_url, started))
    )
    streamer.start()
    assert started.wait(DEADLINE_S)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    saw_503 = wait_for(lambda: _health(server.base_url) == 503, FAIL_WITHIN_S, interval_s=0.05)
    streamer.join(DEADLINE_S)
    code = server.process.wait(DEADLINE_S)
    return saw_503, result, killed_at, code


def _health(base_url: str) -> int | None:
    try:
        return httpx.get(base_url + "/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return None

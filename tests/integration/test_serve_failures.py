"""A worker process dies under `kvflow serve` (SIGKILL, mid-stream).

Within the restart budget nothing is lost: the launcher restarts the worker, the
scheduler resumes every stream by recomputation, and each stream ends with exactly the
tokens of a run without the kill (greedy, and seeded sampling); meanwhile /health says 503 "recovering", and the
metrics count the restart and the resumed requests. With the budget spent, the streams
fail with an in-band error naming the cause, and `kvflow serve` exits 1 with no process
left behind (so that Docker's or systemd's restart policy takes over).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    child_pid,
    group_members,
    metric_values,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

pytestmark = pytest.mark.slow

# Deadlines only, for a loaded 2-core machine: the worker reloads its model (seconds),
# a broken server never finishes, and the client's read timeout then fails the test.
STREAM_DEADLINE_S = 120.0
PROMPTS = ["A very long story:", "Once upon a time", "The list of primes:", "Dear diary,"]
# Greedy, except the last stream: seeded sampling, whose generator must replay too.
SAMPLING = [{"temperature": 0.0}] * 3 + [{"temperature": 1.0, "seed": 1234}]
MAX_TOKENS = 300
LONGEST_STREAM = 500  # the tiny model's 512 positions, less the prompts


def _stream(
    base_url: str,
    prompt: str,
    sampling: dict[str, Any],
    started: threading.Event | None,
    max_tokens: int = MAX_TOKENS,
    far_along: threading.Event | None = None,
) -> dict[str, Any]:
    """One completion stream: its text, finish reasons and errors. `started` is set at
    its third token, `far_along` at a sixth of `max_tokens`."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        **sampling,
    }
    text, finishes, errors = [], [], []
    first_token_at = finished_at = float("inf")
    with (
        httpx.Client(timeout=STREAM_DEADLINE_S) as http,
        http.stream("POST", base_url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        for event in sse_events(response):
            if not isinstance(event, dict):
                continue
            if "error" in event:
                errors.append(event["error"]["message"])
            for choice in event.get("choices", []):
                text.append(choice["text"])
                first_token_at = min(first_token_at, time.monotonic())
                finishes.append(choice.get("finish_reason"))
                if choice.get("finish_reason"):
                    finished_at = time.monotonic()
                if started is not None and len(text) >= 3:
                    started.set()
                if far_along is not None and len(text) >= max_tokens // 6:
                    far_along.set()
    return {
        "text": "".join(text),
        "finish": [f for f in finishes if f],
        "errors": errors,
        "first_token_at": first_token_at,
        "finished_at": finished_at,
    }


def _run_streams(
    base_url: str, on_started: Any = None, max_tokens: int = MAX_TOKENS, early: bool = True
) -> list[dict[str, Any]]:
    """Every prompt at once; `on_started()` runs once each stream has a few tokens, or
    (`early`) as soon as one stream is a sixth of the way through: on a loaded machine
    the streams start staggered, and waiting for the last one let the first ones finish
    first."""
    events = [threading.Event() for _ in PROMPTS]
    far_along = threading.Event() if on_started else None
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(
                _stream,
                base_url,
                prompt,
                sampling,
                event if on_started else None,
                max_tokens,
                far_along,
            )
            for prompt, sampling, event in zip(PROMPTS, SAMPLING, events, strict=True)
        ]
        if far_along is not None:
            deadline = time.monotonic() + STREAM_DEADLINE_S
            while not ((early and far_along.is_set()) or all(e.is_set() for e in events)):
                assert time.monotonic() < deadline, "the streams never started"
                far_along.wait(0.002)
            on_started()
        return [future.result() for future in futures]


class _HealthLog:
    """Polls /health in a thread: (status, body) in order of change."""

    def __init__(self, base_url: str) -> None:
        self.seen: list[tuple[int, str]] = []
        self._url = base_url + "/health"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.05):
            try:
                response = httpx.get(self._url, timeout=5.0)
            except httpx.HTTPError:
                continue
            item = (response.status_code, response.text)
            if not self.seen or self.seen[-1] != item:
                self.seen.append(item)

    def stop(self) -> list[tuple[int, str]]:
        self._done.set()
        self._thread.join()
        return self.seen


# With n-gram speculation the kill may land while a request verifies drafts: it must
# resume like any other (no verification result comes back for it).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_worker_sigkill_mid_stream_loses_nothing(
    tiny_model_dir: Path, tmp_path: Path, spec: dict[str, Any] | None
) -> None:
    extra = ["--max-worker-restarts", "2", "--worker-restart-backoff", "0.2"]
    if spec is not None:
        extra += ["--speculative-config", json.dumps(spec)]
    server = start_server(tiny_model_dir, tmp_path, *extra)
    try:
        reference = _run_streams(server.base_url)
        assert all(r["finish"] == ["length"] and not r["errors"] for r in reference)
        worker = child_pid(server.pid, "kvflow-worker0")
        assert worker is not None
        health = _HealthLog(server.base_url)
        killed_at: list[float] = []

        def kill() -> None:
            os.kill(worker, signal.SIGKILL)
            killed_at.append(time.monotonic())

        crashed = _run_streams(server.base_url, kill)
        took = time.monotonic() - killed_at[0]
        assert wait_for(lambda: health.seen[-1][0] == 200, STREAM_DEADLINE_S)
        seen = health.stop()
        new_worker = child_pid(server.pid, "kvflow-worker0")
        metrics = metric_values(server.base_url)
    finally:
        code, survivors = stop_server(server)
    for got, want in zip(crashed, reference, strict=True):
        assert not got["errors"], got["errors"]
        assert got["finish"] == ["length"]
        assert got["text"] == want["text"]  # no token lost, duplicated or changed
    assert new_worker is not None and new_worker != worker
    recovering = [body for status, body in seen if status == 503]
    assert recovering and "recovering" in recovering[0], seen
    assert seen[-1][0] == 200
    assert metrics["kvflow:worker_restarts_total"] == 1
    if spec is not None:  # the streams did speculate
        assert metrics["kvflow:spec_decode_num_drafts_total"] > 0
    # Every stream that had tokens and had not finished at the kill resumed; one that
    # was still waiting for its first token may have been admitted (then it resumed
    # too) or not yet. (On a loaded machine one may have finished before the kill.)
    unfinished = [got for got in crashed if got["finished_at"] > killed_at[0]]
    streaming = sum(1 for got in unfinished if got["first_token_at"] < killed_at[0])
    resumed = metrics["kvflow:requests_resumed_total"]
    assert streaming >= 1 and streaming <= resumed <= len(unfinished)
    assert survivors == [] and code == 0, server.log_tail()
    print(f"\nworker SIGKILL -> every stream finished {took:.1f} s later; health: {seen}")


def test_restart_budget_spent_fails_requests_and_exits_nonzero(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_model_dir, tmp_path, "--max-worker-restarts", "0")
    try:
        worker = child_pid(server.pid, "kvflow-worker0")
        assert worker is not None and worker in group_members(server.pid)
        killed_at: list[float] = []

        def kill() -> None:
            os.kill(worker, signal.SIGKILL)
            killed_at.append(time.monotonic())

        # As long as the tiny model allows: the kill must land before any stream ends,
        # however late a loaded machine runs this thread after the streams started, and
        # after every stream started (each must fail in-band).
        results = _run_streams(server.base_url, kill, max_tokens=LONGEST_STREAM, early=False)
        failed_after = time.monotonic() - killed_at[0]
        code = server.process.wait(STREAM_DEADLINE_S)  # exits on its own
        exited_after = time.monotonic() - killed_at[0]
    finally:
        stop_code, survivors = stop_server(server)
    for result in results:
        assert result["errors"] and "length" not in result["finish"], result
        message = result["errors"][-1]
        assert "worker rank 0" in message and "restart budget spent" in message, message
    assert code == stop_code == 1, server.log_tail()
    assert survivors == [], server.log_tail()
    assert "restart budget spent" in server.log_tail()
    print(f"\nstreams failed after {failed_after:.2f} s; exit 1 after {exited_after:.1f} s")

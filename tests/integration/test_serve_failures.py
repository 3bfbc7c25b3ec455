"""A worker process dies under `kvflow serve`: /health turns 503, the stream in flight
fails fast with an in-band error, new requests are refused, and SIGTERM still leaves
no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    child_pid,
    group_members,
    sse_events,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow

# Deadlines only, for a loaded 2-core machine: a working server fails the stream within
# the heartbeat timeout (5 s; a dropped connection is faster), a broken one never does,
# and the client's read timeout then ends the test with an error.
STREAM_DEADLINE_S = 60.0


def test_worker_death_is_reported_and_fails_requests_fast(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_model_dir, tmp_path)
    try:
        worker = child_pid(server.pid, "kvflow-worker0")
        assert worker is not None and worker in group_members(server.pid)
        body = {
            "model": MODEL_NAME,
            "prompt": "A very long story:",
            "max_tokens": 480,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(timeout=STREAM_DEADLINE_S) as http,
            http.stream("POST", server.base_url + "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = sse_events(response)
            first = next(events)
            assert first["choices"][0]["text"] is not None
            os.kill(worker, signal.SIGKILL)
            killed_at = time.monotonic()
            rest = list(events)  # must end on its own, before the read timeout
            failed_after = time.monotonic() - killed_at
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        finishes = [
            c.get("finish_reason")
            for e in rest
            if isinstance(e, dict)
            for c in e.get("choices", [])
        ]
        assert errors and rest[-1] == "[DONE]", rest[-3:]
        assert "worker rank 0" in errors[-1]["error"]["message"], errors[-1]
        assert "length" not in finishes
        health = httpx.get(server.base_url + "/health", timeout=5.0)
        assert health.status_code == 503
        # Refused up front (503, not queued for an engine that is gone).
        refused = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
            timeout=STREAM_DEADLINE_S,
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        print(
            f"\nstartup {server.startup_s:.1f} s; in-flight stream failed after "
            f"{failed_after:.2f} s"
        )
    finally:
        code, survivors = stop_server(server)
    assert survivors == [], server.log_tail()
    assert code == 0, server.log_tail()

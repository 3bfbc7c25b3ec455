"""SIGTERM while a stream is in flight: the stream ends (finished or with an in-band
error, never hanging), the launcher exits 0 and no process of its group survives."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import MODEL_NAME, group_members, sse_events, start_server, stop_server

pytestmark = pytest.mark.slow


def test_sigterm_ends_streams_and_leaves_no_orphans(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path)
    members = group_members(server.pid)
    assert len(members) >= 4  # launcher + worker + scheduler + detokenizer
    started = threading.Event()
    events: list[Any] = []

    def stream() -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": "Count to a thousand:",
            "max_tokens": 200,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(timeout=60.0) as http,
            http.stream("POST", server.base_url + "/v1/completions", json=body) as response,
        ):
            for event in sse_events(response):
                events.append(event)
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(30.0)
    finally:
        stopping = time.monotonic()
        code, survivors = stop_server(server)
        stop_s = time.monotonic() - stopping
        reader.join(30.0)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
    assert survivors == [], server.log_tail()
    assert code == 0, server.log_tail()
    assert all(pid not in group_members(server.pid) for pid in members)
    print(f"\nstartup {server.startup_s:.1f} s; shutdown {stop_s:.2f} s")

"""`kvflow serve --pipeline-parallel-size 2`: two stages (gloo send/recv on loopback).

Served greedy completions equal the offline one-process engine's (chunked prefill,
prefix hits, n > 1, a stop string), with the step trace showing one track per stage.
Then the first stage is SIGKILLed during a stream: the stream ends with an error within
seconds, /health turns 503, and `kvflow serve` exits 1 with no process left behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from serve_harness import child_pid, group_members, start_server, stop_server
from test_serve_tensor_parallel import FAIL_WITHIN_S, _offline_tp1, _served, kill_during_a_stream

pytestmark = pytest.mark.slow


def test_served_pp2_equals_offline_and_a_killed_stage_ends_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    probe = _offline_tp1(tiny_model_dir, None)
    stop = probe[2][0][len(probe[2][0]) // 2 :][:3]
    want = _offline_tp1(tiny_model_dir, stop)
    trace = tmp_path / "trace.json"
    server = start_server(
        tiny_model_dir, tmp_path, "--pipeline-parallel-size", "2", "--num-threads", "1",
        "--max-num-batched-tokens", "16", "--trace-file", str(trace),
    )  # fmt: skip
    try:
        got = _served(server.base_url, stop)
        stage0 = child_pid(server.pid, "kvflow-worker0")
        assert stage0 is not None and child_pid(server.pid, "kvflow-worker1") is not None
        saw_503, result, killed_at, code = kill_during_a_stream(server, stage0)
    finally:
        stop_code, survivors = stop_server(server)
    assert got == want
    assert saw_503
    assert result["errors"], result
    assert re.search(r"worker rank [01]", result["errors"][-1]), result["errors"]
    assert result["ended"] - killed_at < FAIL_WITHIN_S
    assert code == stop_code == 1, server.log_tail()
    assert survivors == [] and group_members(server.pid) == [], server.log_tail()
    _assert_a_track_per_stage(trace)


def _assert_a_track_per_stage(trace: Path) -> None:
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    stages = {e["args"]["stage"] for e in events if e.get("ph") == "X" and "stage" in e["args"]}
    assert stages == {0, 1}

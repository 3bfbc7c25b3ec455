"""`kvflow bench disagg` on the tiny model: one command starts a colocated server, then
a prefill and a decode server (zmq connector) behind `kvflow proxy`, runs the same mixed
load against each, and reports ITL/TTFT of both with every request answered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

KVFLOW = Path(sys.executable).with_name("kvflow")
# A small pool: the scheduler's idle integrity check walks every block.
ENGINE = ["--dtype", "float32", "--device", "cpu", "--block-size", "8", "--num-blocks", "128"]
ENGINE += ["--num-threads", "2", "--no-pin"]
LOAD = ["--duration", "2", "--short-rate", "2", "--short-prompt", "8", "--short-output", "6"]
LOAD += ["--long-every", "1", "--long-prompt", "48", "--long-output", "2"]


def test_bench_disagg_json(tiny_model_dir: Path) -> None:
    command = [str(KVFLOW), "bench", "disagg", "--model", str(tiny_model_dir), *ENGINE, *LOAD]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["split"]["num_threads"] == {"colocated": 2, "prefill": 1, "decode": 1}
    assert report["split"]["cpus"] == {"colocated": None, "prefill": None, "decode": None}
    for setup in ("colocated", "disaggregated"):
        result = report[setup]
        assert result["failed_requests"] == 0, result["first_error"]
        assert (result["short_requests"], result["long_requests"]) == (4, 2)
        assert result["short_itl_count"] == 4 * 5  # 6 tokens each: 5 gaps
        itl, ttft, long = result["short_itl_ms"], result["short_ttft_ms"], result["long_ttft_ms"]
        assert 0 < itl["p50"] <= itl["p99"] <= itl["max"]
        assert 0 < ttft["p50"] <= ttft["p99"]
        assert 0 < long["p50"] <= long["max"]

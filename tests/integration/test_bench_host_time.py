"""`kvflow bench host-time`: a decode step split into forward, sampler and host time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from serve_harness import KVFLOW


def test_host_time_splits_decode_steps(tiny_model_dir: Path) -> None:
    command = [str(KVFLOW), "bench", "host-time", "--model", str(tiny_model_dir)]
    command += ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64"]
    command += ["--batch-sizes", "1", "4", "--steps", "5", "--warmup-steps", "2"]
    command += ["--penalties", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["batch_size"] for row in rows] == [1, 4]
    for row in rows:
        assert row["steps"] == 5  # decode-only steps after the warm-up
        assert row["forward_ms"] > 0 and row["sampler_ms"] > 0
        # host = execute - forward - sampler, per step (medians of each part need not add up)
        assert 0 <= row["host_ms"] < row["execute_ms"]
        assert row["forward_ms"] + row["sampler_ms"] <= row["execute_ms"] * 1.5
        assert row["host_share"] == row["host_ms"] / row["execute_ms"]

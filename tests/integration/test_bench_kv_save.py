"""`kvflow bench kv-save` on the tiny model: a producer's prompt step timed three ways
(no save, save after the forward, save layer by layer) in one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

KVFLOW = Path(sys.executable).with_name("kvflow")


def test_bench_kv_save_json(tiny_model_dir: Path) -> None:
    command = [str(KVFLOW), "bench", "kv-save", "--model", str(tiny_model_dir), "--json"]
    command += ["--dtype", "float32", "--device", "cpu", "--num-threads", "1"]
    command += [
        "--num-blocks",
        "64",
        "--block-size",
        "8",
        "--prompt-tokens",
        "100",
        "--rounds",
        "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    modes = ["none", "after_forward", "by_layer"]
    assert (report["prompt_tokens"], report["rounds"]) == (100, 1)
    assert all(report["step_s"][mode] > 0 for mode in modes)
    assert report["save_wait_s"]["none"] == 0.0  # nothing saved without the connector
    assert report["save_wait_s"]["after_forward"] > 0.0
    assert report["step_vs_none"]["none"] == 1.0

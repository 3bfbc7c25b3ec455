"""`kvflow bench startup` on the tiny model: it launches `kvflow serve`, times it to
/health and to the first streamed token, and reports the server's own phases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import ENGINE_ARGS

pytestmark = pytest.mark.slow

KVFLOW = Path(sys.executable).with_name("kvflow")
LAUNCHER_PHASES = ["launcher_process_start", "frontend_import", "model_resolve"]
WORKER_PHASES = [
    "worker_process_start",
    "worker_torch_import",
    "tokenizer_load",
    "native_kernels",  # on CPU
    "model_load",
    "roofline_calibration",
    "kv_cache_profile",
    "kv_cache_allocate",
]


def test_bench_startup_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "startup.json"
    command = [str(KVFLOW), "bench", "startup", "--model", str(tiny_model_dir), *ENGINE_ARGS]
    command += ["--num-iters", "1", "--json", "--output-json", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report == json.loads(output.read_text())
    assert report["num_iters"] == 1
    flags = report["serve_flags"]  # in the config's field order, not the command's
    expected = ["--model", str(tiny_model_dir), *ENGINE_ARGS]
    assert dict(zip(flags[::2], flags[1::2])) == dict(zip(expected[::2], expected[1::2]))
    (run,) = report["runs"]
    health, first_token = run["time_to_health_s"], run["time_to_first_token_s"]
    assert 0 < health < first_token
    assert report["time_to_health_s"] == {"mean": health, "min": health}
    assert report["time_to_first_token_s"] == {"mean": first_token, "min": first_token}
    # Every phase, in the order they ran: one after another, all before /health is 200.
    assert list(run["phases"]) == [*LAUNCHER_PHASES, *WORKER_PHASES]
    assert all(seconds >= 0 for seconds in run["phases"].values())
    assert run["phases"]["model_load"] > 0 and run["phases"]["launcher_process_start"] > 0
    assert run["after_phases_s"] == pytest.approx(health - sum(run["phases"].values()), abs=2e-4)
    assert run["after_phases_s"] > 0
    assert report["phases_s"]["model_load"]["min"] == run["phases"]["model_load"]

"""tests/gpu/run_gpu_checks.sh without a GPU (every step skipped, exit 0, one JSON), and
its collector on the raw outputs a GPU run leaves (statuses, counts, headline figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from collect_gpu_checks import RESULT_FILE, collect, main

SCRIPT = Path(__file__).with_name("run_gpu_checks.sh")
STEPS = {
    "parity", "kernels_cuda", "bench_kernels", "host_time", "throughput_graphs",
    "throughput_eager", "step_profile", "attention_sweep", "kernels_compiled",
}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs every check")
def test_script_without_cuda_skips_every_step_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device: the GPU checks are skipped (not a failure)" in done.stdout
    result = json.loads((tmp_path / "out" / RESULT_FILE).read_text())
    assert result["ok"] is True and result["failed_steps"] == []
    assert result["env"]["cuda"] is False and result["env"]["torch"] == torch.__version__
    assert set(result["steps"]) == STEPS
    for step in result["steps"].values():
        assert step == {"status": "skipped", "rc": None, "reason": "no CUDA device"}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
 errors="0" failures="1" skipped="1" tests="4"><testcase classname="tests.gpu.t" name="a"/>
<testcase classname="tests.gpu.t" name="b"><failure message="boom"/></testcase>
<testcase classname="tests.gpu.t" name="c"/><testcase classname="tests.gpu.t" name="d">
<skipped/></testcase></testsuite></testsuites>"""


def _gpu_run(raw: Path) -> None:
    """What a GPU run leaves: a failing pytest step, benches with logs before their JSON,
    a step killed by its timeout and one skipped for the time budget."""
    raw.mkdir(parents=True)
    files = {
        "env.json": json.dumps({"cuda": True, "device": "NVIDIA H100 80GB HBM3"}),
        "parity.rc": "1", "parity.secs": "61", "parity.xml": JUNIT, "parity.log": "F",
        "host_time.rc": "0", "host_time.secs": "30",
        "host_time.out": "loading\n" + json.dumps([
            {"batch_size": 1, "execute_ms": 4.0, "host_ms": 0.5},
            {"batch_size": 64, "execute_ms": 9.0, "host_ms": 1.5},
        ]),
        "bench_kernels.rc": "0",
        "bench_kernels.out": json.dumps({"results": [
            {"kernel": "decode_attention", "impl": "triton", "time_ms": 0.02},
        ]}),
        "throughput_graphs.rc": "0",
        "throughput_graphs.out": json.dumps({"kvflow": {"output_tokens_per_s": 9000.0}}),
        "throughput_eager.rc": "124", "throughput_eager.log": "still running",
        "kernels_compiled.skip": "time budget: 450 s spent before this step",
    }  # fmt: skip
    for name, text in files.items():
        (raw / name).write_text(text)


def test_collector_reports_statuses_counts_and_figures(tmp_path: Path) -> None:
    _gpu_run(tmp_path / "raw")
    result = collect(tmp_path)
    steps = result["steps"]
    assert result["ok"] is False
    assert result["failed_steps"] == ["parity", "throughput_eager"]
    assert steps["parity"]["status"] == "failed" and steps["parity"]["seconds"] == 61
    tests = steps["parity"]["tests"]
    assert (tests["tests"], tests["failures"], tests["skipped"]) == (4, 1, 1)
    assert tests["failed_tests"] == ["tests.gpu.t::b"]
    assert steps["throughput_eager"]["status"] == "timeout"
    assert steps["throughput_eager"]["log_tail"] == "still running"
    assert steps["kernels_compiled"]["status"] == "skipped"
    assert steps["host_time"]["status"] == "passed"
    assert result["summary"] == {
        "output_tokens_per_s_graphs": 9000.0,
        "output_tokens_per_s_eager": None,
        "host_ms_per_decode_step_batch1": 0.5,
        "step_ms_batch1": 4.0,
        "host_ms_per_decode_step_batch64": 1.5,
        "step_ms_batch64": 9.0,
        "kernel_times_ms": {"decode_attention/triton": 0.02},
    }
    assert result["env"]["device"] == "NVIDIA H100 80GB HBM3"


def test_collector_main_writes_one_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _gpu_run(tmp_path / "raw")
    assert main(["collect_gpu_checks.py", str(tmp_path)]) == 0
    assert json.loads((tmp_path / RESULT_FILE).read_text())["ok"] is False
    assert "FAILED: parity, throughput_eager" in capsys.readouterr().out


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_attention_sweep_smoke_checks_every_configuration_against_sdpa() -> None:
    """The sweep's configurations agree with SDPA (interpreted here; timed on a GPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("decode_attention_sweep.py")), "--smoke"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (shape,) = _last_json(done.stdout)["shapes"].values()
    assert shape["configs"] == 3 and shape["failed"] == []
    assert shape["default"]["max_abs_err"] < 1e-4


def test_step_profile_reports_ops_and_host_functions(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
    from serve_harness import build_tiny_llama

    build_tiny_llama(tmp_path / "model")
    script = SCRIPT.with_name("decode_step_profile.py")
    done = subprocess.run(
        [sys.executable, str(script), "--model", str(tmp_path / "model"), "--batch-sizes", "1",
         "3", "--steps", "2", "--warmup-steps", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = _last_json(done.stdout)
    assert set(report) == {"1", "3"}
    for batch in report.values():
        assert batch["step_ms"] > 0 and batch["kernels"] and batch["host"]
        assert all(row["own_us_per_step"] >= 0 for row in batch["host"])

"""`kvflow serve` start-up failures: a clear message naming the role, exit code 1, and
no process left behind."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from serve_harness import ENGINE_ARGS, KVFLOW, free_port, group_members

pytestmark = pytest.mark.slow


def serve_until_exit(*args: str, timeout_s: float = 120.0) -> tuple[int, str, float]:
    """Run `kvflow serve`; (exit code, stderr, seconds), after its group is gone."""
    command = [str(KVFLOW), "serve", "--port", str(free_port()), *args]
    start = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    _, stderr = process.communicate(timeout=timeout_s)
    took = time.monotonic() - start
    deadline = time.monotonic() + 10.0
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(process.pid) == [], "children outlived a failed start"
    return process.returncode, stderr.decode(errors="replace"), took


def test_unknown_model_path(tmp_path: Path) -> None:
    code, stderr, _ = serve_until_exit("--model", str(tmp_path / "missing"))
    assert code == 1
    assert f"model '{tmp_path / 'missing'}' is neither" in stderr


def test_worker_failure_is_named(tiny_model_dir: Path) -> None:
    code, stderr, took = serve_until_exit(
        "--model", str(tiny_model_dir), *ENGINE_ARGS[:4], "--kv-cache-memory", "1e-9"
    )
    assert code == 1
    assert "kvflow serve: worker rank 0 failed to start: KV cache memory too small" in (stderr)
    print(f"\nfailed start reported after {took:.1f} s")


def test_startup_timeout_names_the_late_roles(tiny_model_dir: Path) -> None:
    code, stderr, took = serve_until_exit(
        "--model", str(tiny_model_dir), *ENGINE_ARGS, "--startup-timeout", "0.5"
    )
    assert code == 1
    assert "kvflow serve: timed out after 0.5 s waiting for: worker rank 0, scheduler" in stderr
    print(f"\ntimed-out start ended after {took:.1f} s")


def test_a_tensor_parallel_size_that_does_not_split_the_model() -> None:
    # The embedded model: 9 attention heads, 3 KV heads; refused before any child starts.
    code, stderr, _ = serve_until_exit(*ENGINE_ARGS, "--tensor-parallel-size", "2")
    assert code == 1
    assert (
        "kvflow serve: tensor_parallel_size=2 must divide the model's 9 attention heads, "
        "its 1536 MLP columns and its 3 KV heads (or be a multiple of them); "
        "sizes that fit: 1, 3"
    ) in stderr
    assert "worker rank" not in stderr

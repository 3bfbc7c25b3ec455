"""Each role as its own command over tcp, addresses from KVFLOW_ADDR_* (how compose runs
them): a completion goes through, and SIGTERM to the scheduler stops its workers and
detokenizer too."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import ENGINE_ARGS, KVFLOW, MODEL_NAME, free_port

pytestmark = pytest.mark.slow

ROLES = ["worker", "scheduler", "detokenizer", "frontend"]


def test_roles_over_tcp(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    for channel in (
        "scheduler_input",
        "worker_plan",
        "worker_result",
        "detokenizer_input",
        "frontend_output",
        "stats",
    ):
        env[f"KVFLOW_ADDR_{channel.upper()}"] = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    common = ["--model", str(tiny_model_dir), "--served-model-name", MODEL_NAME, *ENGINE_ARGS]
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role in ROLES:
            extra = ["--port", str(port)] if role == "frontend" else []
            with open(tmp_path / f"{role}.log", "wb") as log:
                processes[role] = subprocess.Popen(
                    [str(KVFLOW), role, *common, *extra], env=env, stdout=log, stderr=log
                )
        url = f"http://127.0.0.1:{port}"
        assert _wait_healthy(url, processes, 240.0), _logs(tmp_path)
        reply = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hi there", "max_tokens": 5, "ignore_eos": True},
            timeout=60.0,
        ).json()
        assert reply["usage"]["completion_tokens"] == 5, reply
        processes["scheduler"].send_signal(signal.SIGTERM)
        for role in ("scheduler", "worker", "detokenizer"):
            assert processes[role].wait(20.0) == 0, _logs(tmp_path)
        processes["frontend"].send_signal(signal.SIGTERM)
        assert processes["frontend"].wait(20.0) == 0, _logs(tmp_path)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def _wait_healthy(url: str, processes: dict[str, subprocess.Popen[bytes]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes.values()):
            return False
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {role}\n" + (tmp_path / f"{role}.log").read_text(errors="replace")[-3000:]
        for role in ROLES
    )

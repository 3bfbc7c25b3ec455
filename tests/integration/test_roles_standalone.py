"""Each role as its own command over tcp, addresses from KVFLOW_ADDR_* (how compose runs
them): a completion goes through, SIGTERM to the scheduler stops its workers and
detokenizer too, and a scheduler killed outright can be restarted onto the running
worker, detokenizer and frontend."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_harness import ENGINE_ARGS, KVFLOW, MODEL_NAME, free_port

pytestmark = pytest.mark.slow

ROLES = ["worker", "scheduler", "detokenizer", "frontend"]
CHANNELS = (
    "scheduler_input",
    "worker_plan",
    "worker_result",
    "detokenizer_input",
    "frontend_output",
    "stats",
)


class Stack:
    """The four roles as separate processes on loopback tcp, logs under tmp_path."""

    def __init__(self, model_dir: Path, tmp_path: Path) -> None:
        self.env = dict(os.environ)
        for channel in CHANNELS:
            self.env[f"KVFLOW_ADDR_{channel.upper()}"] = f"tcp://127.0.0.1:{free_port()}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.common = ["--model", str(model_dir), "--served-model-name", MODEL_NAME]
        self.common += ENGINE_ARGS
        self.tmp_path = tmp_path
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, log_name: str | None = None) -> None:
        extra = ["--port", str(self.port)] if role == "frontend" else []
        with open(self.tmp_path / f"{log_name or role}.log", "wb") as log:
            self.processes[role] = subprocess.Popen(
                [str(KVFLOW), role, *self.common, *extra], env=self.env, stdout=log, stderr=log
            )

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes.values()):
                return False
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def complete(self, max_tokens: int, timeout: float = 60.0) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": "Hi there", "max_tokens": max_tokens}
        return httpx.post(
            self.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=timeout
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.stem}\n" + path.read_text(errors="replace")[-3000:]
            for path in sorted(self.tmp_path.glob("*.log"))
        )

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tiny_model_dir, tmp_path)
    try:
        for role in ROLES:
            stack.start(role)
        assert stack.wait_healthy(240.0), stack.logs()
        yield stack
    finally:
        stack.stop_all()


def test_roles_over_tcp(stack: Stack) -> None:
    reply = stack.complete(5).json()
    assert reply["usage"]["completion_tokens"] == 5, reply
    processes = stack.processes
    processes["scheduler"].send_signal(signal.SIGTERM)
    for role in ("scheduler", "worker", "detokenizer"):
        assert processes[role].wait(20.0) == 0, stack.logs()
    processes["frontend"].send_signal(signal.SIGTERM)
    assert processes["frontend"].wait(20.0) == 0, stack.logs()


def test_killed_scheduler_restarts_onto_running_workers(stack: Stack) -> None:
    assert stack.complete(5).json()["usage"]["completion_tokens"] == 5
    worker_pid = stack.processes["worker"].pid
    lines: list[str] = []
    streaming = threading.Event()

    def stream_long_request() -> None:  # running when the scheduler dies
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True}
        with httpx.stream(
            "POST", stack.url + "/v1/completions", json={**body, "stream": True}, timeout=120.0
        ) as response:
            for line in response.iter_lines():
                lines.append(line)
                streaming.set()

    thread = threading.Thread(target=stream_long_request)
    thread.start()
    assert streaming.wait(60.0), stack.logs()
    stack.processes["scheduler"].kill()  # SIGKILL: no EngineDead, no Shutdown to anyone
    stack.processes["scheduler"].wait()
    stack.start("scheduler", log_name="scheduler-restarted")
    thread.join(120.0)
    assert not thread.is_alive(), stack.logs()
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2], events[-3:]  # the stream ends with an error, not "length"
    assert '"length"' not in "".join(events)

    assert stack.wait_healthy(120.0), stack.logs()
    assert stack.processes["worker"].pid == worker_pid  # the same worker, not a new one
    reply = stack.complete(7).json()
    assert reply["usage"]["completion_tokens"] == 7, (reply, stack.logs())

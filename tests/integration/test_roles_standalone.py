"""Each role as its own command over tcp, addresses from KVFLOW_ADDR_* (how compose runs
them): a completion goes through, SIGTERM to the scheduler stops its workers and
detokenizer too, a scheduler killed outright can be restarted onto the running
worker, detokenizer and frontend, and a killed frontend, detokenizer or worker can be
started again and serves. A stream running through a scheduler's, a detokenizer's or a
worker's death goes on to the text of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from serve_harness import ENGINE_ARGS, KVFLOW, MODEL_NAME, auth_failures, free_port, wait_for

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

    def complete(
        self, max_tokens: int, timeout: float = 60.0, prompt: str = "Hi there"
    ) -> httpx.Response:
        """A greedy completion of `max_tokens` tokens."""
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
        body |= {"ignore_eos": True, "temperature": 0.0}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)

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
    # A peer without the cluster secret is refused by the scheduler and the detokenizer,
    # and the frontend's /metrics counts it under the role that refused it.
    # Linger 0 on every socket: a socket closed with the default (wait forever) and a
    # message its refused peer never takes blocks the context's term() for good.
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    intruders = []
    for channel in ("scheduler_input", "detokenizer_input"):
        intruders.append(context.socket(zmq.PUSH))
        intruders[-1].connect(stack.env[f"KVFLOW_ADDR_{channel.upper()}"])
        intruders[-1].send(b"\x00")
    refused = {"scheduler": 0.0, "detokenizer": 0.0}

    def counted() -> bool:
        refused.update(auth_failures(stack.url))
        return refused["scheduler"] > 0 and refused["detokenizer"] > 0

    assert wait_for(counted, 10.0), refused
    for intruder in intruders:
        intruder.close(linger=0)
    context.term()
    assert stack.complete(5).json()["usage"]["completion_tokens"] == 5  # still serving
    processes = stack.processes
    processes["scheduler"].send_signal(signal.SIGTERM)
    for role in ("scheduler", "worker", "detokenizer"):
        assert processes[role].wait(20.0) == 0, stack.logs()
    processes["frontend"].send_signal(signal.SIGTERM)
    assert processes["frontend"].wait(20.0) == 0, stack.logs()


def test_killed_scheduler_restarts_onto_running_workers(stack: Stack) -> None:
    """The frontend holds the stream while no scheduler runs, and sends it again with
    its tokens so far to the restarted one: it ends at its full length with the text of
    an uninterrupted run, and no error."""
    assert stack.complete(5).json()["usage"]["completion_tokens"] == 5
    expected = stack.complete(LongStream.MAX_TOKENS, prompt=LongStream.PROMPT).json()
    worker_pid = stack.processes["worker"].pid
    stream = LongStream(stack)
    stack.processes["scheduler"].kill()  # SIGKILL: no EngineDead, no Shutdown to anyone
    stack.processes["scheduler"].wait()
    stack.start("scheduler", log_name="scheduler-restarted")
    stream.assert_complete(expected["choices"][0]["text"], timeout=120.0)
    assert "holding 1 in-flight request" in (stack.tmp_path / "frontend.log").read_text()

    assert stack.wait_healthy(120.0), stack.logs()
    assert stack.processes["worker"].pid == worker_pid  # the same worker, not a new one
    reply = stack.complete(7).json()
    assert reply["usage"]["completion_tokens"] == 7, (reply, stack.logs())


# ---- restarting the other roles -----------------------------------------------------
# One stack serves the three tests below (a stack takes 30 s or more to start here):
# each kills a role while a stream runs, starts it again and checks that the service
# serves again, so each leaves the stack serving for the next.


@pytest.fixture(scope="module")
def shared_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tiny_model_dir, tmp_path_factory.mktemp("roles"))
    try:
        for role in ROLES:
            stack.start(role)
        assert stack.wait_healthy(240.0), stack.logs()
        yield stack
    finally:
        stack.stop_all()


class LongStream:
    """A greedy streamed completion in a thread, already streaming when the constructor
    returns."""

    PROMPT = "Hi"
    MAX_TOKENS = 500

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lines: list[str] = []
        self.streaming = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.streaming.wait(60.0), stack.logs()

    def _run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": self.PROMPT, "max_tokens": self.MAX_TOKENS}
        body |= {"ignore_eos": True, "temperature": 0.0}
        url = self.stack.url + "/v1/completions"
        try:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120.0) as r:
                for line in r.iter_lines():
                    self.lines.append(line)
                    self.streaming.set()
        except httpx.HTTPError as exc:  # the frontend itself was killed
            self.lines.append(f"connection lost: {exc}")

    def events(self, timeout: float = 60.0) -> list[str]:
        """The `data:` payloads, once the stream has ended (it must, within `timeout`)."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream never ended\n" + self.stack.logs()
        return [line.removeprefix("data: ") for line in self.lines if line.startswith("data: ")]

    def assert_complete(self, expected_text: str, timeout: float) -> None:
        """The stream ended at its full length with `expected_text`, and no error."""
        events = self.events(timeout)
        assert events[-1] == "[DONE]" and '"length"' in events[-2], events[-3:]
        assert not any('"error"' in event for event in events), events
        chunks = [json.loads(event) for event in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text


def _kill(stack: Stack, role: str) -> None:
    stack.processes[role].kill()  # SIGKILL: the role says nothing to anyone
    stack.processes[role].wait()


def _health(stack: Stack) -> int:
    try:
        return httpx.get(stack.url + "/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return 0


def _serves(stack: Stack) -> None:
    assert stack.wait_healthy(120.0), stack.logs()
    reply = stack.complete(7).json()
    assert reply["usage"]["completion_tokens"] == 7, (reply, stack.logs())


def test_killed_frontend_restarts(shared_stack: Stack) -> None:
    stack = shared_stack
    stream = LongStream(stack)
    _kill(stack, "frontend")
    assert stream.events()[-1:] != ["[DONE]"]  # the connection just dropped
    stack.start("frontend", log_name="frontend-restarted")  # same port, new frontend id
    _serves(stack)


def test_killed_detokenizer_restarts(shared_stack: Stack) -> None:
    """A new detokenizer has no state for the old requests and drops their deltas: the
    frontend aborts them on the scheduler, holds them while none is connected (not ready
    meanwhile) and sends them again once one is: the stream goes on without an error."""
    stack = shared_stack
    expected = stack.complete(LongStream.MAX_TOKENS, prompt=LongStream.PROMPT).json()
    stream = LongStream(stack)
    _kill(stack, "detokenizer")
    deadline = time.monotonic() + 10.0
    while _health(stack) != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(stack) == 503
    stack.start("detokenizer", log_name="detokenizer-restarted")
    stream.assert_complete(expected["choices"][0]["text"], timeout=120.0)
    _serves(stack)


def test_killed_worker_restarts_and_the_stream_resumes(shared_stack: Stack) -> None:
    """docs/deployment.md: the scheduler sees its worker die, preempts its requests and
    waits (503 "recovering"); a restarted worker (compose's restart policy) answers its
    hello, and the stream goes on to its full length without an error."""
    stack = shared_stack
    expected = stack.complete(LongStream.MAX_TOKENS, prompt=LongStream.PROMPT).json()
    stream = LongStream(stack)
    _kill(stack, "worker")
    deadline = time.monotonic() + 30.0
    while _health(stack) != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(stack) == 503
    stack.start("worker", log_name="worker-restarted")
    stream.assert_complete(expected["choices"][0]["text"], timeout=120.0)
    assert stack.processes["scheduler"].poll() is None, stack.logs()  # the same scheduler
    _serves(stack)

"""A tensor-parallel engine as separate role commands over tcp (how compose's `tp`
profile runs it, without Docker): `kvflow worker --rank 0|1 --tensor-parallel-size 2
--distributed-init-method tcp://127.0.0.1:<port>` as two processes, plus the scheduler,
detokenizer and frontend. Greedy output equals the offline TP=1 engine's, and SIGTERM
to the scheduler stops both ranks (each hears Shutdown on the plan socket)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_harness import free_port
from test_roles_standalone import Stack

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

TP = ["--tensor-parallel-size", "2", "--num-threads", "1"]
PROMPT = "In a quiet village by the sea there lived"
MAX_TOKENS = 8


def _start_rank(stack: Stack, rank: int, rendezvous: str) -> None:
    common = stack.common
    stack.common = [*common, "--rank", str(rank), "--distributed-init-method", rendezvous]
    try:
        stack.start("worker", log_name=f"worker{rank}")
    finally:
        stack.common = common
    stack.processes[f"worker{rank}"] = stack.processes.pop("worker")


@pytest.fixture
def tp_stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tiny_model_dir, tmp_path)
    stack.common += TP
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    try:
        # Rank 1 first: it waits for rank 0's store, as a container started early would.
        for rank in (1, 0):
            _start_rank(stack, rank, rendezvous)
        for role in ("scheduler", "detokenizer", "frontend"):
            stack.start(role)
        assert stack.wait_healthy(240.0), stack.logs()
        yield stack
    finally:
        stack.stop_all()


def test_two_rank_processes_serve_what_one_rank_computes(
    tp_stack: Stack, tiny_model_dir: Path
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    reply = httpx.post(
        tp_stack.url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=120.0
    ).json()
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS, reply
    llm = LLM(str(tiny_model_dir), dtype="float32", num_threads=1, num_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (reference,) = llm.generate([PROMPT], params)
    assert reply["choices"][0]["text"] == reference.outputs[0].text
    processes = tp_stack.processes
    processes["scheduler"].send_signal(signal.SIGTERM)
    for role in ("scheduler", "worker0", "worker1", "detokenizer"):
        assert processes[role].wait(30.0) == 0, f"{role}\n{tp_stack.logs()}"

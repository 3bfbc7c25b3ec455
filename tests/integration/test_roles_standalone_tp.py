"""A tensor-parallel engine as separate role commands over tcp (how compose's `tp`
profile runs it, without Docker): `kvflow worker --rank 0|1 --tensor-parallel-size 2
--distributed-init-method tcp://127.0.0.1:<port>` as two processes, plus the scheduler,
detokenizer and frontend. Greedy output equals the offline TP=1 engine's, SIGTERM
to the scheduler stops both ranks (each hears Shutdown on the plan socket), and a rank
killed while the group idles brings the group back (the survivor is told to leave it)."""

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


class TpStack(Stack):
    rendezvous = ""  # rank 0's store: tcp://127.0.0.1:<port>


@pytest.fixture
def tp_stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[TpStack]:
    stack = TpStack(tiny_model_dir, tmp_path)
    stack.common += TP
    stack.rendezvous = f"tcp://127.0.0.1:{free_port()}"
    try:
        # Rank 1 first: it waits for rank 0's store, as a container started early would.
        for rank in (1, 0):
            _start_rank(stack, rank, stack.rendezvous)
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


def test_a_rank_killed_while_the_group_idles_brings_the_group_back(tp_stack: TpStack) -> None:
    """Rank 0 dies between requests. Rank 1, alive in the old group, would learn of it
    only at its next collective, and the restarted rank 0 would wait at the rendezvous
    for ever: the recovering scheduler's hello tells rank 1 to leave (exit 1), and both
    ranks, restarted as a restart policy would, form the group again and serve."""
    processes = tp_stack.processes
    processes["worker0"].kill()
    processes["worker0"].wait()
    _start_rank(tp_stack, 0, tp_stack.rendezvous)
    assert processes["worker1"].wait(120.0) == 1, tp_stack.logs()
    _start_rank(tp_stack, 1, tp_stack.rendezvous)
    assert tp_stack.wait_healthy(240.0), tp_stack.logs()
    reply = tp_stack.complete(MAX_TOKENS, timeout=120.0)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS

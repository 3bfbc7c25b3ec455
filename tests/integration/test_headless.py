"""`kvflow serve --headless`: engine 1 runs in a second `kvflow serve` process (as it
would on another host) and joins the frontend's process, which runs engine 0; greedy
outputs equal one engine's and both engines serve."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq
from serve_harness import (
    ENGINE_ARGS,
    KVFLOW,
    MODEL_NAME,
    Server,
    auth_failures,
    child_pid,
    free_port,
    group_members,
    listening_ports,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

DP = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--block-size", "16"]


@pytest.fixture(scope="module")
def two_hosts(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, subprocess.Popen[bytes]]]:
    logs = tmp_path_factory.mktemp("headless")
    rpc = ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port())]
    command = [str(KVFLOW), "--log-level", "info", "serve", "--model", str(tiny_model_dir)]
    command += ["--headless", *DP, "--data-parallel-start-rank", "1", *rpc, *ENGINE_ARGS]
    with open(logs / "headless.log", "wb") as log:
        headless = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        server = start_server(tiny_model_dir, logs, *DP, *rpc)
    except BaseException:
        headless.kill()
        raise
    yield server, headless
    code, survivors = stop_server(server)
    assert survivors == [] and code == 0, server.log_tail()
    headless.terminate()
    assert headless.wait(60) == 0, (logs / "headless.log").read_text()[-3000:]
    # Its children die with it (PR_SET_PDEATHSIG), a moment after it exits.
    assert wait_for(lambda: group_members(headless.pid) == [], 10.0), group_members(headless.pid)


def _complete(url: str, prompt: list[int]) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    response = httpx.post(url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_a_headless_engine_serves_beside_the_local_one(
    two_hosts: tuple[Server, subprocess.Popen[bytes]], tiny_model_dir: Path
) -> None:
    server, _ = two_hosts
    prompts = [[100 + (s * 7919 + i * 104729) % 30000 for i in range(20)] for s in range(12)]
    with ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(lambda p: _complete(server.base_url, p), prompts))
    llm = LLM(str(tiny_model_dir), dtype="float32", num_blocks=512, block_size=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert texts == [o.outputs[0].text for o in llm.generate(prompts, params)]
    for rank in (0, 1):  # each engine answers a request sent to it by rank
        body = {"model": MODEL_NAME, "prompt": prompts[0], "max_tokens": 8, "temperature": 0.0}
        body |= {"ignore_eos": True, "data_parallel_rank": rank}
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert response.json()["choices"][0]["text"] == texts[0]
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'kvflow:router_requests_total{engine="1",model_name="tiny",policy="rank"} 1.0' in (
        metrics
    ), metrics


def test_a_dead_headless_engine_restarts_on_its_host_and_rejoins(
    two_hosts: tuple[Server, subprocess.Popen[bytes]],
) -> None:
    server, headless = two_hosts
    url = server.base_url
    scheduler = child_pid(headless.pid, "kvflow-e1-sched")
    assert scheduler is not None
    os.kill(scheduler, signal.SIGKILL)

    def health() -> tuple[int, bytes]:
        response = httpx.get(url + "/health", timeout=5.0)
        return response.status_code, response.content

    def degraded() -> bool:
        code, content = health()
        return code == 200 and content != b""

    # Its silence takes it out of routing; the other engine keeps serving meanwhile.
    assert wait_for(degraded, 60.0), server.log_tail()
    assert httpx.get(url + "/health").json()["engines"]["0"] == "ok"
    # Restarted on its host on the same ports: the frontend's sockets reconnect.
    assert wait_for(lambda: health() == (200, b""), 240.0), server.log_tail()
    body = {"model": MODEL_NAME, "prompt": [100, 200, 300], "max_tokens": 4}
    # The restarted engine's first request pays its warm-up (~5 s on a loaded 2-core
    # machine, before and after the layout change alike): httpx's default 5 s is too tight.
    response = httpx.post(
        url + "/v1/completions", json=body | {"data_parallel_rank": 1}, timeout=60
    )
    assert response.status_code == 200, response.text


def test_the_headless_engine_refuses_a_peer_without_the_secret(
    two_hosts: tuple[Server, subprocess.Popen[bytes]],
) -> None:
    """Its sockets are on tcp (another host would reach them): a peer without the
    cluster secret is refused by its scheduler, and the frontend's /metrics counts it
    under the engine that refused it."""
    server, headless = two_hosts
    scheduler = child_pid(headless.pid, "kvflow-e1-sched")
    assert scheduler is not None
    ports = listening_ports(scheduler)
    assert len(ports) == 4  # scheduler_input, worker_plan, worker_result, stats
    context = zmq.Context()
    try:
        for port in ports:
            intruder = context.socket(zmq.PUSH)
            intruder.connect(f"tcp://127.0.0.1:{port}")
        assert wait_for(lambda: auth_failures(server.base_url).get("scheduler", 0) >= 4, 10.0)
    finally:
        context.destroy(linger=0)
    _complete(server.base_url, [101, 102, 103])  # still serving (a 200)

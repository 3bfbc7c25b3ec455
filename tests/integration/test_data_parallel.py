"""`kvflow serve --data-parallel-size 2` end to end on the tiny random model: outputs equal
one engine's, 64 concurrent streams, routing by prefix beats round-robin on prefix-cache
hits, one engine's death moves its requests to the other (and the engine comes back),
and a worker's death is resumed by its own engine: no request is lost either way."""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    Server,
    by_engine,
    child_pid,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams

DP2 = ["--data-parallel-size", "2", "--block-size", "16"]


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("dp"), *DP2)
    yield server
    code, survivors = stop_server(server)
    assert survivors == [], f"orphans after SIGTERM: {survivors}\n{server.log_tail()}"
    assert code == 0, server.log_tail()


def _prompt(seed: int, length: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def _stream(base_url: str, prompt: list[int], max_tokens: int) -> tuple[list[str], str | None]:
    """(text pieces, then the finish reason; error message or None) of one streamed
    greedy completion."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0.0, "ignore_eos": True}
    pieces: list[str] = []
    finish = None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return pieces, r.read().decode()
        for event in sse_events(r):
            if not isinstance(event, dict):  # the closing [DONE]
                break
            if "error" in event:
                return pieces, event["error"]["message"]
            pieces += [c["text"] for c in event["choices"]]
            finish = event["choices"][0].get("finish_reason") or finish
    return [*pieces, finish or ""], None


def test_64_concurrent_streams_equal_one_engine(dp_server: Server, tiny_model_dir: Path) -> None:
    prompts = [_prompt(seed) for seed in range(64)]
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda p: _stream(dp_server.base_url, p, 12), prompts))
    assert all(error is None for _, error in results), [e for _, e in results if e]
    llm = LLM(str(tiny_model_dir), dtype="float32", num_blocks=512, block_size=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert all(pieces[-1] == "length" for pieces, _ in results)
    assert ["".join(pieces[:-1]) for pieces, _ in results] == offline
    assert len(set(offline)) > 32  # each stream got its own tokens, not a neighbour's
    routed = by_engine(dp_server.base_url, "kvflow:router_requests_total")
    assert routed["0"] > 0 and routed["1"] > 0, routed  # both engines served
    # Request-level series carry the engine that served the request.
    served = by_engine(dp_server.base_url, "kvflow:request_success_total")
    assert served == routed, (served, routed)


def test_offline_llm_refuses_data_parallelism(tiny_model_dir: Path) -> None:
    from kvflow.errors import ConfigError

    with pytest.raises(ConfigError, match="data-parallel-size"):
        LLM(str(tiny_model_dir), data_parallel_size=2)


def _shared_prefix_workload(base_url: str) -> float:
    """8 groups of 6 prompts, each group sharing a 256-token prefix; the hit rate."""
    before = (
        sum(by_engine(base_url, "kvflow:prefix_cache_hits_total").values()),
        sum(by_engine(base_url, "kvflow:prefix_cache_queries_total").values()),
    )
    prompts = [_prompt(1000 + g, 256) + _prompt(i, 16) for i in range(6) for g in range(8)]
    for start in range(0, len(prompts), 8):  # a wave at a time: earlier waves are cached
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: _stream(base_url, p, 2), prompts[start : start + 8]))
    time.sleep(1.5)  # the engines' next stats carry the last counts
    hits = sum(by_engine(base_url, "kvflow:prefix_cache_hits_total").values()) - before[0]
    queries = sum(by_engine(base_url, "kvflow:prefix_cache_queries_total").values()) - before[1]
    return hits / queries


def test_prefix_aware_beats_round_robin_on_cache_hits(
    dp_server: Server, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prefix_aware = _shared_prefix_workload(dp_server.base_url)
    hits = by_engine(dp_server.base_url, "kvflow:router_prefix_hits_total")
    assert sum(hits.values()) >= 32, hits
    rr = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("rr"), *DP2, "--load-balance", "round-robin"
    )
    try:
        round_robin = _shared_prefix_workload(rr.base_url)
    finally:
        stop_server(rr)
    print(
        f"\nprefix-cache hit rate: prefix-aware {prefix_aware:.3f}, round-robin {round_robin:.3f}"
    )
    # Round-robin sends a group's 6 prompts to both engines: each engine computes the
    # prefix once per group (16 of 48 miss); prefix-aware computes it once (8 of 48).
    assert prefix_aware > round_robin + 0.05


def _offline(tiny_model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[str]:
    llm = LLM(str(tiny_model_dir), dtype="float32", num_blocks=512, block_size=16)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def _kill_mid_stream(url: str, pid: int, prompts: list[list[int]]) -> list[Any]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, url, p, 200) for p in prompts]
        time.sleep(3.0)  # every stream is decoding
        os.kill(pid, signal.SIGKILL)
        return [f.result() for f in futures]


def test_an_engine_death_moves_its_requests_and_it_comes_back(
    dp_server: Server, tiny_model_dir: Path
) -> None:
    url = dp_server.base_url
    prompts = [_prompt(5000 + i) for i in range(12)]
    scheduler = child_pid(dp_server.pid, "kvflow-e1-sched")
    assert scheduler is not None
    results = _kill_mid_stream(url, scheduler, prompts)
    # Engine 1's streams moved to engine 0 with their tokens so far: no error, and the
    # text of an uninterrupted run.
    assert [e for _, e in results if e is not None] == []
    assert ["".join(p[:-1]) for p, _ in results] == _offline(tiny_model_dir, prompts, 200)
    assert "re-routed" in dp_server.log_path.read_text(), dp_server.log_tail()
    # The supervisor restarts engine 1; its new incarnation puts it back into routing.
    assert wait_for(lambda: _healthy(url), timeout_s=240.0), dp_server.log_tail()
    before = by_engine(url, "kvflow:router_requests_total").get("1", 0.0)
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda i: _stream(url, _prompt(9000 + i), 4), range(8)))
    assert all(e is None for _, e in again), again
    assert by_engine(url, "kvflow:router_requests_total")["1"] > before


def test_a_worker_death_is_resumed_by_its_engine(dp_server: Server, tiny_model_dir: Path) -> None:
    url = dp_server.base_url
    assert wait_for(lambda: _healthy(url), timeout_s=240.0), dp_server.log_tail()
    prompts = [_prompt(7000 + i) for i in range(12)]
    worker = child_pid(dp_server.pid, "kvflow-e1-w0")
    assert worker is not None
    results = _kill_mid_stream(url, worker, prompts)
    assert [e for _, e in results if e is not None] == []
    assert ["".join(p[:-1]) for p, _ in results] == _offline(tiny_model_dir, prompts, 200)
    assert wait_for(lambda: _healthy(url), timeout_s=120.0), dp_server.log_tail()
    assert child_pid(dp_server.pid, "kvflow-e1-sched") is not None  # the engine lived on


def _wait_degraded(url: str) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def degraded() -> bool:
        response = httpx.get(url + "/health", timeout=5.0)
        if response.status_code == 200 and response.content:
            found.update(json.loads(response.content))
            return True
        return False

    assert wait_for(degraded, timeout_s=30.0)
    assert found["status"] == "degraded"
    return found


def _healthy(url: str) -> bool:
    response = httpx.get(url + "/health", timeout=5.0)
    return response.status_code == 200 and not response.content


def test_an_explicit_data_parallel_rank_wins(dp_server: Server) -> None:
    url = dp_server.base_url
    before = by_engine(url, "kvflow:router_requests_total", policy="rank")
    for rank in (1, 1, 0):
        body = {"model": MODEL_NAME, "prompt": _prompt(7), "max_tokens": 2}
        response = httpx.post(
            url + "/v1/completions", json=body | {"data_parallel_rank": rank}, timeout=60
        )
        assert response.status_code == 200, response.text
    after = by_engine(url, "kvflow:router_requests_total", policy="rank")
    assert after["1"] - before.get("1", 0.0) == 2 and after["0"] - before.get("0", 0.0) == 1
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "data_parallel_rank": 2}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "data_parallel_rank"


def test_two_api_servers_share_the_port(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from serve_harness import listening_sockets

    server = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("api2"), "--api-server-count", "2"
    )
    try:
        port = int(server.base_url.rsplit(":", 1)[1])
        # Each listens once it has heard from the engine; the first answers /health.
        assert wait_for(lambda: len(listening_sockets(port)) == 2, 30.0)
        assert set(listening_sockets(port)) == {"127.0.0.1"}
        assert child_pid(server.pid, "kvflow-api1") is not None
        # Every request on a fresh connection: the kernel spreads them over both; none
        # meets a frontend that has not heard from the engine yet (a 503).
        for i in range(24):
            body = {"model": MODEL_NAME, "prompt": _prompt(i), "max_tokens": 2}
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text

        # Each frontend counts what it routed, and publishes its share for the other:
        # a scrape, whichever process the kernel picks, shows the sum (24) every time.
        def summed() -> bool:
            return by_engine(server.base_url, "kvflow:router_requests_total")["0"] == 24

        assert wait_for(summed, timeout_s=30.0)
        assert all(summed() for _ in range(10))
        # ... and both routed some (their published shares).
        (shares,) = [d for d in Path(tempfile.gettempdir()).glob("kvflow-metrics-*")]
        routed = [_routed_in_share(path) for path in sorted(shares.glob("*.json"))]
        assert len(routed) == 2 and all(r > 0 for r in routed) and sum(routed) == 24, routed
    finally:
        code, survivors = stop_server(server)
    assert survivors == [] and code == 0, server.log_tail()


def _routed_in_share(path: Path) -> float:
    families = json.loads(path.read_text())
    (family,) = [f for f in families if f["name"] == "kvflow:router_requests"]
    return sum(v for name, _, v in family["samples"] if name.endswith("_total"))


def test_standalone_roles_of_two_engines_behind_one_frontend(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """How compose's `dp` profile runs them: each engine's roles with their own addresses
    (engine 1's scheduler says `--engine-id 1`), one frontend with KVFLOW_E1_ADDR_*."""
    import subprocess

    from serve_harness import ENGINE_ARGS, KVFLOW, free_port

    common = ["--model", str(tiny_model_dir), "--served-model-name", MODEL_NAME, *ENGINE_ARGS]
    e0, e1 = _tcp_env(), _tcp_env()
    e1_for_frontend = {k.replace("KVFLOW_", "KVFLOW_E1_"): v for k, v in e1.items()}
    port = free_port()
    roles = [
        (e0, ["worker"]),
        (e0, ["scheduler"]),
        (e0, ["detokenizer"]),
        (e1, ["worker"]),
        (e1, ["scheduler", "--engine-id", "1"]),
        (e1, ["detokenizer"]),
        ({**e0, **e1_for_frontend}, ["frontend", "--port", str(port), "--data-parallel-size", "2"]),
    ]
    processes = []
    try:
        for index, (env, args) in enumerate(roles):
            with open(tmp_path / f"role{index}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [str(KVFLOW), args[0], *common, *args[1:]],
                        env={**os.environ, **env},
                        stdout=log,
                        stderr=log,
                    )
                )
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _healthy_quiet(url), timeout_s=240.0), _logs(tmp_path)
        for rank in (0, 1, 1):
            body = {"model": MODEL_NAME, "prompt": _prompt(3), "max_tokens": 3}
            response = httpx.post(
                url + "/v1/completions", json=body | {"data_parallel_rank": rank}, timeout=60
            )
            assert response.status_code == 200, response.text
        routed = by_engine(url, "kvflow:router_requests_total", policy="rank")
        assert routed == {"0": 1.0, "1": 2.0}
        assert wait_for(
            lambda: set(by_engine(url, "kvflow:num_requests_running")) == {"0", "1"}, 10.0
        )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def _tcp_env() -> dict[str, str]:
    from serve_harness import free_port

    from kvflow.proto.addresses import ServiceAddresses

    return {
        f"KVFLOW_ADDR_{channel.upper()}": f"tcp://127.0.0.1:{free_port()}"
        for channel in ServiceAddresses.channels()
    }


def _healthy_quiet(url: str) -> bool:
    try:
        return _healthy(url)
    except httpx.HTTPError:
        return False


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.stem}\n" + p.read_text(errors="replace")[-2000:]
        for p in sorted(tmp_path.glob("*.log"))
    )

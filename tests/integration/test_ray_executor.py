"""`kvflow serve --distributed-executor-backend ray` on a local Ray cluster of two nodes
(127.0.0.1): the head has the CPUs of one TP=1 engine (2), the second node those of one
two-rank engine (3). A TP=2 (or PP=2) engine's bundle (3 CPUs) fits the second node
only: it is placed there whole, both ranks under its one actor, and serves what one
rank computes. Then two
TP=1 engines (2 CPUs each) must land on different nodes: greedy outputs equal one
engine's, both nodes serve, and the loss of one node takes its engine out of routing
while the other keeps serving.

The cluster is this test's own (ray.cluster_utils.Cluster, a private RAY_TMPDIR): it is
shut down at the end, and nothing else's Ray is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, start_server, stop_server, wait_for

from kvflow import LLM, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
NODE_CPUS = 2  # one engine's bundle on CPU: scheduler + detokenizer, and one worker rank
TP_NODE_CPUS = 3  # the second node: one TP=2 engine's bundle (scheduler + detokenizer, 2 ranks)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Any, Any]]:
    """(cluster, the second node): a head and one more raylet, both on 127.0.0.1."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    # Short: Ray's unix socket paths live under it (at most 107 characters).
    temp_dir = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    saved_local = os.environ.get(LOCAL_ONLY)
    os.environ["RAY_TMPDIR"] = temp_dir  # for this process and `kvflow serve`
    # Else Ray's driver replaces a 127.0.0.1 address by the host's outside address,
    # where this cluster does not listen.
    os.environ[LOCAL_ONLY] = "0"
    node = {
        "num_cpus": NODE_CPUS,
        "node_ip_address": "127.0.0.1",
        "object_store_memory": 80 * 1024**2,  # kvflow never puts data in it
    }
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args=node | {"include_dashboard": False, "resources": {"kvflow_node_a": 1}},
    )
    try:
        second = cluster.add_node(
            **(node | {"num_cpus": TP_NODE_CPUS}), resources={"kvflow_node_b": 1}
        )
        yield cluster, second
    finally:
        cluster.shutdown()
        for name, value in (("RAY_TMPDIR", saved), (LOCAL_ONLY, saved_local)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_server(
    ray_cluster: tuple[Any, Any], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    cluster, _ = ray_cluster
    args = ["--data-parallel-size", "2", "--block-size", "16", "--num-threads", "1"]
    args += ["--distributed-executor-backend", "ray", "--ray-address", cluster.address]
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("ray"), *args)
    yield server
    code, survivors = stop_server(server)
    assert survivors == [], f"orphans after SIGTERM: {survivors}\n{server.log_tail()}"
    assert code == 0, server.log_tail()
    # The engines' processes are the actors' children, outside the server's group.
    actors = {int(pid) for pid in re.findall(r"EngineHost pid=(\d+)", _log(server))}
    assert len(actors) == 2
    assert wait_for(lambda: not _alive_under(actors), timeout_s=30.0), _alive_under(actors)


def _prompt(seed: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 30000 for i in range(20)]


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[str | None, str]:
    """(text, "") of a greedy completion, or (None, the error)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0.0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    if response.status_code != 200:
        return None, response.text
    return response.json()["choices"][0]["text"], ""


def _routed(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "kvflow:router_requests_total":
                engine = sample.labels["engine"]
                totals[engine] = totals.get(engine, 0.0) + sample.value
    return totals


def _all_engines_serve(url: str) -> bool:
    """/health is 200 with a "degraded" body while some engine does not serve."""
    response = httpx.get(url + "/health", timeout=5.0)
    return response.status_code == 200 and "degraded" not in response.text


def _log(server: Server) -> str:
    return server.log_path.read_text(errors="replace")


def _placements(server: Server) -> dict[str, str]:
    """engine -> Ray node id, from the launcher's log."""
    return dict(re.findall(r"engine (\d+) placed on Ray node (\w+)", _log(server)))


def _alive_under(actors: set[int]) -> list[int]:
    """The actors and their children that still run (zombies excluded)."""
    alive = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
        if state != "Z" and (int(entry) in actors or int(ppid) in actors):
            alive.append(int(entry))
    return alive


def _children_names(pid: int) -> set[str]:
    """/proc/<child>/comm of `pid`'s live children (the engine's processes set theirs)."""
    names = set()
    for entry in _alive_under({pid}):
        if entry != pid:
            try:
                names.add(Path(f"/proc/{entry}/comm").read_text().strip())
            except OSError:
                continue
    return names


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_tp_engine_is_placed_whole_on_the_node_that_fits_it(
    ray_cluster: tuple[Any, Any], tiny_model_dir: Path, tmp_path: Path, tp: int, pp: int
) -> None:
    """Two ranks, of one TP group or of two pipeline stages: one bundle either way."""
    cluster, second = ray_cluster
    args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    args += ["--block-size", "16", "--num-threads", "1"]
    args += ["--distributed-executor-backend", "ray", "--ray-address", cluster.address]
    server = start_server(tiny_model_dir, tmp_path, *args)
    try:
        # The bundle {"CPU": 3} fits the second node only (the head has 2 CPUs).
        assert _placements(server) == {"0": second.node_id}, server.log_tail()
        (actor,) = {int(pid) for pid in re.findall(r"EngineHost pid=(\d+)", _log(server))}
        # Both ranks are the one actor's children: on its node, in its bundle.
        assert {"kvflow-e0-w0", "kvflow-e0-w1"} <= _children_names(actor), _log(server)
        prompts = [_prompt(seed) for seed in range(4)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: _complete(server.base_url, p), prompts))
    finally:
        code, survivors = stop_server(server)
    assert survivors == [] and code == 0, server.log_tail()
    assert wait_for(lambda: not _alive_under({actor}), timeout_s=30.0), _alive_under({actor})
    llm = LLM(str(tiny_model_dir), dtype="float32", num_blocks=512, block_size=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert [text for text, _ in results] == reference, results


def test_two_nodes_serve_what_one_engine_computes(ray_server: Server, tiny_model_dir: Path) -> None:
    placements = _placements(ray_server)
    assert set(placements) == {"0", "1"} and len(set(placements.values())) == 2, placements
    # Ready means one engine serves; the router sends only to engines that do.
    assert wait_for(lambda: _all_engines_serve(ray_server.base_url), timeout_s=60.0)
    prompts = [_prompt(seed) for seed in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _complete(ray_server.base_url, p), prompts))
    assert all(text is not None for text, _ in results), results
    llm = LLM(str(tiny_model_dir), dtype="float32", num_blocks=512, block_size=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [text for text, _ in results] == [
        o.outputs[0].text for o in llm.generate(prompts, params)
    ]
    routed = _routed(ray_server.base_url)
    assert routed["0"] > 0 and routed["1"] > 0, routed  # both nodes served


def test_a_lost_node_takes_its_engine_out_of_routing(
    ray_server: Server, ray_cluster: tuple[Any, Any]
) -> None:
    cluster, second = ray_cluster
    url = ray_server.base_url
    lost = next(e for e, node in _placements(ray_server).items() if node == second.node_id)
    cluster.remove_node(second)
    removed_at = time.monotonic()

    def degraded() -> bool:
        response = httpx.get(url + "/health", timeout=5.0)
        return response.status_code == 200 and bool(response.content)

    assert wait_for(degraded, timeout_s=60.0), ray_server.log_tail()
    health = httpx.get(url + "/health", timeout=5.0).json()
    assert health["status"] == "degraded"
    assert health["engines"][lost] != "ok" and health["engines"][str(1 - int(lost))] == "ok"
    assert time.monotonic() - removed_at < 60
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda i: _complete(url, _prompt(900 + i), 4), range(8)))
    assert all(text is not None for text, _ in again), again  # the other node serves all

"""The `dp` profile of compose.yaml: two engines (the default one and worker-e1 /
scheduler-e1 / detokenizer-e1) behind `frontend-dp`, brought up for real by
`make test-compose` (the static checks need no Docker)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator

import pytest
from test_compose import (
    COMPOSE_FILE,
    PROJECT,
    REQUEST_TIMEOUT_S,
    UP_TIMEOUT_S,
    compose_command,
    compose_services,
    expected_addresses,
    free_port,
    live,
    print_logs,
    run,
    timed,
)

E1_ROLES = ("worker-e1", "scheduler-e1", "detokenizer-e1")


def test_every_role_has_a_healthcheck_of_its_own() -> None:
    """The image's HEALTHCHECK asks HTTP on port 8000, which only a frontend answers: a
    role without its own check never turns healthy (worker-e1 did not, before)."""
    for name, service in compose_services().items():
        if service.get("image", "").startswith("${KVFLOW_IMAGE"):
            assert "healthcheck" in service, name


def test_the_second_engine_has_an_address_table_of_its_own() -> None:
    services = compose_services()
    e1 = {
        k: v.replace("scheduler:", "scheduler-e1:").replace("detokenizer:", "detokenizer-e1:")
        for k, v in expected_addresses().items()
    }
    for role in E1_ROLES:
        assert services[role]["environment"] == e1, role
        assert services[role]["profiles"] == ["dp"]
    env = services["frontend-dp"]["environment"]
    assert {k: env[k] for k in expected_addresses()} == expected_addresses()
    e1_addresses = {k: v for k, v in e1.items() if k.startswith("KVFLOW_ADDR_")}
    assert {
        k.replace("KVFLOW_E1_", "KVFLOW_"): v for k, v in env.items() if "_E1_" in k
    } == e1_addresses
    assert services["scheduler-e1"]["command"][-2:] == ["--engine-id", "1"]
    assert "--data-parallel-size" in services["frontend-dp"]["command"]


@pytest.fixture(scope="module")
def dp_api() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "KVFLOW_DP_HTTP_PORT": str(port), "KVFLOW_HTTP_PORT": str(free_port())}
    env["KVFLOW_PROMETHEUS_PORT"] = str(free_port())
    compose = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", PROJECT, "--profile", "dp"]
    run([*compose, "down", "-v", "--remove-orphans", "--timeout", "10"], env, timeout=180)
    start = time.monotonic()
    wait = ["--wait", "--wait-timeout", str(UP_TIMEOUT_S)]
    up = run([*compose, "up", "-d", *wait, "frontend-dp"], env, 1200)
    timed("dp profile up -d --wait", start)
    try:
        if up.returncode != 0:
            print_logs(compose, env)
            pytest.fail(f"compose up (dp) failed:\n{up.stdout}{up.stderr}")
        yield f"http://127.0.0.1:{port}"
    finally:
        down = run([*compose, "down", "-v", "--remove-orphans", "--timeout", "30"], env, 300)
        assert down.returncode == 0, down.stderr


def _complete(api: str, rank: int) -> dict[str, object]:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
    body |= {"ignore_eos": True, "data_parallel_rank": rank}
    request = urllib.request.Request(
        api + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return dict(json.load(response))


@live
def test_both_engines_answer_a_completion(dp_api: str) -> None:
    # The same greedy prompt on each engine: the same model, so the same text.
    texts = [_complete(dp_api, rank)["choices"][0]["text"] for rank in (0, 1)]  # type: ignore[index]
    assert texts[0] and texts[0] == texts[1]

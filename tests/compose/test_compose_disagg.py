"""The `disagg` profile of compose.yaml: a prefill and a decode `kvflow serve` (zmq KV
connector) behind `kvflow proxy`, brought up for real by `make test-compose` (the
static checks need no Docker)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from test_compose import (
    COMPOSE_FILE,
    PROJECT,
    REPO,
    REQUEST_TIMEOUT_S,
    SECRET_ENV,
    UP_TIMEOUT_S,
    compose_command,
    compose_services,
    free_port,
    live,
    print_logs,
    run,
    timed,
)

from kvflow.kv_transfer_config import KVTransferConfig

DISAGG = ("prefill", "decode", "proxy")


def test_the_profile_pairs_a_producer_and_a_consumer_behind_the_proxy() -> None:
    services = compose_services()
    for name in DISAGG:
        assert services[name]["profiles"] == ["disagg"]
        # Whole `serve`s: no role addresses, only the cluster secret (zmq KV, signed params).
        assert services[name]["environment"] == SECRET_ENV
    producer = KVTransferConfig.parse(services["prefill"]["command"][-1])
    consumer = KVTransferConfig.parse(services["decode"]["command"][-1])
    assert producer.is_producer and not producer.is_consumer and consumer.kv_role == "kv_consumer"
    proxy = services["proxy"]["command"]
    assert proxy[proxy.index("--prefill-kv-address") + 1] == f"tcp://prefill:{producer.kv_port}"
    assert proxy[proxy.index("--prefill") + 1] == "http://prefill:8000"
    assert proxy[proxy.index("--decode") + 1] == "http://decode:8000"
    config = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())
    job = {j["job_name"]: j for j in config["scrape_configs"]}["kvflow-disagg"]
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["prefill:8000", "decode:8000"]


@pytest.fixture(scope="module")
def disagg_api() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "KVFLOW_DISAGG_HTTP_PORT": str(port), "KVFLOW_HTTP_PORT": str(free_port())}
    env["KVFLOW_PROMETHEUS_PORT"] = str(free_port())
    compose = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", PROJECT, "--profile", "disagg"]
    run([*compose, "down", "-v", "--remove-orphans", "--timeout", "10"], env, timeout=180)
    start = time.monotonic()
    wait = ["--wait", "--wait-timeout", str(UP_TIMEOUT_S)]
    up = run([*compose, "up", "-d", *wait, "proxy"], env, 1200)
    timed("disagg profile up -d --wait", start)
    try:
        if up.returncode != 0:
            print_logs(compose, env)
            pytest.fail(f"compose up (disagg) failed:\n{up.stdout}{up.stderr}")
        yield f"http://127.0.0.1:{port}"
    finally:
        down = run([*compose, "down", "-v", "--remove-orphans", "--timeout", "30"], env, 300)
        assert down.returncode == 0, down.stderr


@live
def test_the_proxy_streams_a_chat_completion(disagg_api: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": True,
    }
    request = urllib.request.Request(
        disagg_api + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        lines = [line.decode().strip() for line in response]
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text

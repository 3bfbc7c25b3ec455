"""Disaggregated prefill/decode over HTTP: a producer and a consumer `kvflow serve` with
the shared-storage connector behind `kvflow proxy`. Greedy answers through the proxy
equal the offline colocated engine's; the decode instance computes one prompt token
per sample (the last, which it samples from), from its own metrics; a dead prefill
instance costs time, never the answer, and no instance holds a block afterwards."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    KVFLOW,
    MODEL_NAME,
    Server,
    free_port,
    metric_values,
    signed_kv_params,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = ["--num-threads", "1", "--block-size", "8"]
LONG = "Once upon a time in a land far away there lived a careful engineer. " * 4
CASES: list[tuple[str, dict[str, Any]]] = [
    (LONG, {"max_tokens": 10, "temperature": 0.0}),
    ("Hi", {"max_tokens": 6, "temperature": 0.0, "n": 2}),
    (LONG + "And then", {"max_tokens": 12, "temperature": 0.0, "stop": ["e"]}),
]


def _kv(connector: str, role: str, extra: dict[str, Any]) -> list[str]:
    config = {"kv_role": role, "kv_connector": connector, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module", params=["shared-storage", "zmq"])
def disagg(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, Server, str, str]]:
    logs = tmp_path_factory.mktemp("disagg")
    connector = request.param
    proxy_args: list[str] = []
    if connector == "zmq":
        kv_port = free_port()
        producer = _kv(connector, "kv_producer", {"kv_port": kv_port})
        consumer = [*_kv(connector, "kv_consumer", {}), "--kv-load-timeout", "2"]
        proxy_args = ["--prefill-kv-address", f"tcp://127.0.0.1:{kv_port}"]
    else:
        storage = {"storage_path": str(logs / "kv")}
        producer = _kv(connector, "kv_producer", storage)
        consumer = _kv(connector, "kv_consumer", storage)
    prefill = start_server(tiny_model_dir, logs, *ENGINE, *producer)
    decode = start_server(tiny_model_dir, logs, *ENGINE, *consumer)
    port = free_port()
    command = [str(KVFLOW), "proxy", "--prefill", prefill.base_url, "--decode", decode.base_url]
    command += proxy_args
    with open(logs / "proxy.log", "wb") as log:
        proxy = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_for(up, 60.0), (logs / "proxy.log").read_text()
        yield prefill, decode, url, connector
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        for server in (prefill, decode):
            if server.process.poll() is None:
                stop_server(server)


def _offline(model: Path) -> list[list[str]]:
    llm = LLM(str(model), dtype="float32", device="cpu", num_threads=1, num_blocks=64)
    outputs = llm.generate([p for p, _ in CASES], [SamplingParams(**k) for _, k in CASES])
    return [[c.text for c in o.outputs] for o in outputs]


def _completions(url: str) -> list[list[str]]:
    texts = []
    for prompt, kwargs in CASES:
        body = {"model": MODEL_NAME, "prompt": prompt, **kwargs}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=120.0)
        assert answer.status_code == 200, answer.text
        choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
        texts.append([c["text"] for c in choices])
    return texts


def test_proxy_answers_equal_colocated(
    disagg: tuple[Server, Server, str, str], tiny_model_dir: Path
) -> None:
    prefill, decode, url, _ = disagg
    expected = _offline(tiny_model_dir)
    assert _completions(url) == expected

    # Streamed: the decode instance's SSE arrives through the proxy as it is produced.
    prompt, kwargs = CASES[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "stream": True, **kwargs}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120.0) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected[0][0]

    # Chat: the proxy forwards the route as is; the template is applied on both sides.
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0.0}
    answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120.0)
    assert answer.status_code == 200, answer.text
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_threads=1, num_blocks=64)
    offline = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    assert answer.json()["choices"][0]["message"]["content"] == offline[0].outputs[0].text

    samples = sum(k.get("n", 1) for _, k in CASES) + 2  # + the streamed one and the chat
    computed = "kvflow:kv_transfer_computed_prompt_tokens_total"
    # Stats arrive every 0.5 s: wait until the generation counter has caught up.
    wait_for(lambda: metric_values(decode.base_url).get(computed, 0) >= samples, 5.0)
    decoded = metric_values(decode.base_url)
    # One prompt token per sample: "Hi" is one token (nothing to load, the same count).
    assert decoded[computed] == samples
    assert decoded["kvflow:kv_transfer_loaded_bytes_total"] > 0
    assert metric_values(prefill.base_url)["kvflow:kv_transfer_saved_bytes_total"] > 0


def test_dead_prefill_instance_costs_time_not_the_answer(
    disagg: tuple[Server, Server, str, str], tiny_model_dir: Path
) -> None:
    prefill, decode, url, connector = disagg
    stop_server(prefill)
    prompt = "A prompt that no instance has seen before, long enough for two blocks."
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120.0)
    assert answer.status_code == 200, answer.text
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_threads=1, num_blocks=64)
    expected = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert answer.json()["choices"][0]["text"] == expected[0].outputs[0].text
    assert httpx.get(url + "/health").json()["prefill_failures"] == 1
    # zmq: the decode instance's pull from the dead producer failed, then it recomputed.
    failures = "kvflow:kv_load_failures_total"
    wanted = 1 if connector == "zmq" else 0
    assert wait_for(lambda: metric_values(decode.base_url)[failures] == wanted, 5.0)
    # Idle: no block held (kv_cache_usage counts blocks referenced by a request).
    assert wait_for(lambda: metric_values(decode.base_url)["kvflow:kv_cache_usage_perc"] == 0, 5.0)


def test_fail_policy_answers_an_error_and_frees_the_blocks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    consumer = _kv("zmq", "kv_consumer", {})
    policy = ["--kv-load-failure-policy", "fail", "--kv-load-timeout", "0.5"]
    decode = start_server(tiny_model_dir, tmp_path, *ENGINE, *consumer, *policy)
    try:
        nobody = f"tcp://127.0.0.1:{free_port()}"  # a producer that is not there
        body = {"model": MODEL_NAME, "prompt": LONG, "max_tokens": 4, "temperature": 0.0}
        body["kv_transfer_params"] = signed_kv_params(nobody)  # as the proxy would
        answer = httpx.post(decode.base_url + "/v1/completions", json=body, timeout=60.0)
        assert answer.status_code == 500, answer.text
        assert "could not be loaded" in answer.json()["error"]["message"]
        # Without kv_transfer_params the same instance computes the prompt itself.
        del body["kv_transfer_params"]
        assert httpx.post(decode.base_url + "/v1/completions", json=body, timeout=60.0).is_success

        def settled() -> bool:
            values = metric_values(decode.base_url)
            return (
                values["kvflow:kv_load_failures_total"] == 1
                and values["kvflow:kv_cache_usage_perc"] == 0
            )

        assert wait_for(settled, 5.0), metric_values(decode.base_url)
    finally:
        stop_server(decode)

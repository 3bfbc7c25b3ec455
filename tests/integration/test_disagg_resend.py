"""A decode instance that dies under load costs time, never an answer: behind
`kvflow proxy`, one prefill and two decode instances (shared storage) serve concurrent
greedy completions; one decode instance's whole process group is SIGKILLed while it
holds requests. The proxy prefills and sends those again (and the new ones it would
have routed there) to the live decode instance, so every request answers 200 with the
offline engine's exact text, and the proxy's /metrics counts the resends. With both
decode instances gone, the prefill instance serves requests whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from serve_harness import (
    KVFLOW,
    MODEL_NAME,
    free_port,
    metric_values,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = ["--num-threads", "1", "--block-size", "8"]
PROMPTS = [f"Request {i}: once upon a time in a land far away there lived" for i in range(12)]
MAX_TOKENS = 160  # long enough that the kill lands while the decode instance holds some


def _kv(role: str, storage: Path) -> list[str]:
    config = {
        "kv_role": role,
        "kv_connector": "shared-storage",
        "kv_connector_extra_config": {"storage_path": str(storage)},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def test_a_killed_decode_instance_loses_no_answer(tiny_model_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_threads=1, num_blocks=512)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    del llm

    storage = tmp_path / "kv"
    prefill = start_server(tiny_model_dir, tmp_path, *ENGINE, *_kv("kv_producer", storage))
    decodes = [start_server(tiny_model_dir, tmp_path, *ENGINE, *_kv("kv_consumer", storage))
               for _ in range(2)]  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(KVFLOW), "proxy", "--port", str(port), "--prefill", prefill.base_url]
    for decode in decodes:
        command += ["--decode", decode.base_url]
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, stdout=log, stderr=log)
    try:
        assert wait_for(lambda: _up(url), 60.0), (tmp_path / "proxy.log").read_text()
        answers: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            answers[i] = httpx.post(url + "/v1/completions", json=body, timeout=180.0)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        running = "kvflow:num_requests_running"
        victim = decodes[0]
        assert wait_for(lambda: metric_values(victim.base_url).get(running, 0) > 0, 60.0)
        os.killpg(victim.pid, signal.SIGKILL)  # the whole instance: HTTP, engine, worker
        victim.process.wait(timeout=30)
        for thread in threads:
            thread.join(timeout=180.0)

        assert sorted(answers) == list(range(len(PROMPTS)))
        statuses = {i: (a.status_code, a.text[:200]) for i, a in answers.items()}
        assert all(a.status_code == 200 for a in answers.values()), statuses
        assert [answers[i].json()["choices"][0]["text"] for i in range(len(PROMPTS))] == expected
        resent = httpx.get(url + "/metrics").text
        dropped = 'kvflow:proxy_decode_resends_total{reason="dropped"}'
        assert float(resent.split(dropped)[1].split()[0]) >= 1, resent

        # No decode instance left: the prefill instance (a whole engine) serves it.
        stop_server(decodes[1])
        send(0)
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["choices"][0]["text"] == expected[0]
        assert "kvflow:proxy_prefill_fallbacks_total 1" in httpx.get(url + "/metrics").text
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        for server in (prefill, *decodes):
            if server.process.poll() is None:
                stop_server(server)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False

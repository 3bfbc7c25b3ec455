"""`kvflow serve --speculative-config`: greedy completions equal the offline engine's
without speculation (the embedded model, requests arriving concurrently, async
scheduling), drafts were accepted and show in /metrics under vLLM's names, and a
request's `"speculative": false` opts it out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, metric_values, start_server, stop_server, wait_for

from kvflow import LLM, SamplingParams
from kvflow.bench.serve import spec_decode_counts

pytestmark = pytest.mark.slow

SPEC = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 4.0}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat",
    CODE + "\ndef mul(a, b):\n",
    "Once upon a time, in a land far away, there lived a dragon who",
]
PARAMS: dict[str, Any] = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("serve-spec-decode")
    args = ["--dtype", "float32", "--async-scheduling", "--speculative-config", json.dumps(SPEC)]
    server = start_server(embedded_model_dir, log_dir, *args)
    yield server
    stop_server(server)


def complete(server: Server, prompt: str, **extra: Any) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, **PARAMS, **extra}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_served_speculation_equals_offline_without(
    server: Server, embedded_model_dir: Path
) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(lambda p: complete(server, p), PROMPTS))
    llm = LLM(str(embedded_model_dir), dtype="float32")
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(**PARAMS))]
    assert served == offline

    def accepted() -> float:
        return metric_values(server.base_url).get(
            "kvflow:spec_decode_num_accepted_tokens_total", 0.0
        )

    assert wait_for(lambda: accepted() > 0, timeout_s=10.0)
    metrics = metric_values(server.base_url)
    assert metrics["kvflow:spec_decode_num_draft_tokens_total"] >= accepted()
    assert metrics["kvflow:spec_decode_num_drafts_total"] > 0
    # What `kvflow bench serve` reads for its mean acceptance length.
    counts = spec_decode_counts(server.base_url)
    assert counts is not None and 0 < counts[2] <= counts[1]
    # Opted out: the same text, and the counters do not move.
    before = metric_values(server.base_url)["kvflow:spec_decode_num_draft_tokens_total"]
    assert complete(server, PROMPTS[1], speculative=False) == offline[1]
    wait_for(lambda: False, timeout_s=1.5)  # a stats period
    after = metric_values(server.base_url)["kvflow:spec_decode_num_draft_tokens_total"]
    assert after == before

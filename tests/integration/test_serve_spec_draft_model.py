"""`kvflow serve` with a draft model (the tiny random-weight model as its own draft):
the worker process loads the draft beside the target and sizes both KV caches; greedy
completions of concurrent requests equal the offline engine's without speculation, and
the drafts were accepted (/metrics)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_harness import MODEL_NAME, metric_values, start_server, stop_server, wait_for

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time, in a land far away", "def add(a, b):\n"]
PARAMS = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def test_served_draft_model_equals_offline_without(tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tiny_model_dir
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(target)}
    args = ["--dtype", "float32", "--speculative-config", json.dumps(spec)]
    server = start_server(target, tmp_path, *args)
    try:

        def complete(prompt: str) -> str:
            body = {"model": MODEL_NAME, "prompt": prompt, **PARAMS}
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            served = list(pool.map(complete, PROMPTS))

        def accepted() -> float:
            values = metric_values(server.base_url)
            return values.get("kvflow:spec_decode_num_accepted_tokens_total", 0.0)

        assert wait_for(lambda: accepted() >= 3, timeout_s=10.0)
    finally:
        stop_server(server)
    llm = LLM(str(target), dtype="float32", num_threads=1)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(**PARAMS))]
    assert served == offline

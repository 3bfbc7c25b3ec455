"""`kvflow serve --kv-cache-dtype int8` over HTTP: a chat completion answers, the start-up
log reports the cache dtype, and prefix caching works over quantized blocks.

A prefix-cache hit reads the shared prefix back dequantized, whereas the first request
attended its fresh K/V: their greedy outputs need not be equal. Two hits on the same
quantized blocks compute the same thing, so their outputs must be equal; the first
tokens of all three agree here (asserted on the first 4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    Server,
    metric_values,
    start_server,
    stop_server,
    wait_for,
)

pytestmark = pytest.mark.slow

SHARED = "You are a terse assistant. Answer in one short sentence. " * 3


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("serve-kv-int8")
    server = start_server(
        embedded_model_dir, log_dir, "--kv-cache-dtype", "int8", "--num-threads", "1"
    )
    yield server
    stop_server(server)


def _chat(server: Server, question: str) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}],
        "max_tokens": 12,
        "temperature": 0.0,
    }
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _hits(server: Server) -> float:
    values = metric_values(server.base_url)
    return values.get("kvflow:prefix_cache_hits_total", 0.0)


def test_chat_and_prefix_cache_hits_on_an_int8_cache(server: Server) -> None:
    assert "KV cache:" in server.log_path.read_text() and " int8, " in server.log_path.read_text()
    first = _chat(server, "What is the capital of France?")
    text = first["choices"][0]["message"]["content"]
    assert text.strip() and first["usage"]["completion_tokens"] > 0
    hits_before = _hits(server)
    second = _chat(server, "What is the capital of France?")
    # At least the three 16-token blocks of the system prompt (stats arrive per step).
    assert wait_for(lambda: _hits(server) - hits_before >= 48, 10.0), _hits(server)
    third = _chat(server, "What is the capital of France?")
    assert second["choices"][0]["message"]["content"] == third["choices"][0]["message"]["content"]
    words = text.split()[:4]
    assert second["choices"][0]["message"]["content"].split()[:4] == words

"""A grammar that compiles past `--grammar-compile-timeout` fails its request with a 400
naming the field, in time, while plain requests beside it complete normally."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, start_server, stop_server

TIMEOUT_S = 0.2
# 200 properties of three alternatives each: compiles for about a second here.
SLOW_SCHEMA = {
    "type": "object",
    "properties": {
        f"f{i}": {
            "anyOf": [
                {"type": "string", "pattern": "[a-z]{1,8}"},
                {"type": "integer", "minimum": i},
                {"type": "array", "items": {"type": "number"}, "maxItems": 4},
            ]
        }
        for i in range(200)
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("serve")
    srv = start_server(tiny_model_dir, log_dir, "--grammar-compile-timeout", str(TIMEOUT_S))
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL_NAME, **body}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)


def test_compile_timeout_is_a_400_and_others_complete(server: Server) -> None:
    plain = {"prompt": "hello", "max_tokens": 24, "ignore_eos": True}
    guided = {"prompt": "x", "max_tokens": 8, "guided_json": SLOW_SCHEMA}
    # The machine's own pace (a shared 2-core box may be slow): one tiny request alone.
    start = time.monotonic()
    assert post(server, {"prompt": "x", "max_tokens": 1}).status_code == 200
    baseline = time.monotonic() - start
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(post, server, plain) for _ in range(8)]
        start = time.monotonic()
        response = post(server, guided)
        took = time.monotonic() - start
        results = [f.result() for f in others]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs" and "grammar_compile_timeout" in error["message"]
    assert took < TIMEOUT_S + 1.0 + baseline, (took, baseline)
    for result in results:
        assert result.status_code == 200, result.text
        choice = result.json()["choices"][0]
        assert (
            choice["finish_reason"] == "length"
            and result.json()["usage"]["completion_tokens"] == 24
        )

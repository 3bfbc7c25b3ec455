"""`kvflow serve --skip-tokenizer-init` on a model directory without a tokenizer: token-id
prompts get token ids back (empty text), text prompts and chat get a 400 naming the flag."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, start_server, stop_server

from kvflow.bench.shapes import shape_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = tmp_path_factory.mktemp("config-only")
    shape_config(
        "llama-1b", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        eos_token_id=7,
    ).save_pretrained(model_dir)  # fmt: skip
    log_dir = tmp_path_factory.mktemp("serve-skip-tokenizer")
    server = start_server(
        model_dir, log_dir, "--load-format", "dummy", "--skip-tokenizer-init",
        "--num-threads", "1",
    )  # fmt: skip
    yield server
    stop_server(server)


def _complete(server: Server, prompt: object, **extra: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


def test_token_ids_in_and_out(server: Server) -> None:
    response = _complete(server, [1, 2, 3, 4, 5])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == ""
    assert len(choice["token_ids"]) == 4
    assert response.json()["usage"]["completion_tokens"] == 4


def test_streamed_token_ids(server: Server) -> None:
    response = _complete(server, [1, 2, 3], stream=True)
    assert response.status_code == 200, response.text
    assert "data: [DONE]" in response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_text_is_a_400(server: Server, path: str) -> None:
    body: dict[str, object] = {"model": MODEL_NAME, "max_tokens": 4}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    response = httpx.post(server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "--skip-tokenizer-init" in response.json()["error"]["message"]

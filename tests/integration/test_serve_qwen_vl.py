"""A tiny Qwen2.5-VL served by `kvflow serve`, driven by the openai client: a chat
message with an image as a data: URL (the frontend preprocesses it and computes its
M-RoPE positions) gives transformers' greedy tokens; a second turn with the same image
hits the prefix cache and gives them again; other text before the same image is an
encoder cache hit (kvflow:mm_encoder_cache_hits_total)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llava_fixture import random_image
from qwen_vl_fixture import IMAGE, hf_greedy, make_qwen_vl_dir
from serve_harness import MODEL_NAME, Server, metric_values, start_server, stop_server, wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a real serve of a vision model (~4 processes)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    return make_qwen_vl_dir(tmp_path_factory.mktemp("qwen_vl"), embedded_model_dir)


@pytest.fixture(scope="module")
def server(qwen_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(qwen_vl_dir, tmp_path_factory.mktemp("serve"), "--block-size", "4")
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


def hf_chat(path: Path, messages: list[dict[str, Any]], image: Any) -> tuple[int, str]:
    """(prompt length, greedy text) of transformers on the chat as kvflow renders it:
    the image part as Qwen's vision placeholder, the parts joined by newlines."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids, tokens = hf_greedy(path, text, [image], MAX_TOKENS)
    return len(ids), tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_with_a_data_url_image(server: Server, qwen_vl_dir: Path) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    image = random_image(5, 200, 150)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # type: ignore[attr-defined]
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]

    def ask(*before: dict[str, str]) -> Any:
        return client.chat.completions.create(
            model=MODEL_NAME,
            messages=[*before, {"role": "user", "content": parts}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )

    first = ask()
    length, text = hf_chat(qwen_vl_dir, [{"role": "user", "content": f"{IMAGE}\nWhat?"}], image)
    assert first.usage.prompt_tokens == length
    assert first.choices[0].message.content == text
    again = ask()  # the same image and text: the first's KV, the same positions
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    system = {"role": "system", "content": "Be brief."}
    other = ask(system)  # other text first: its KV computed again at shifted positions
    expected = hf_chat(qwen_vl_dir, [system, {"role": "user", "content": f"{IMAGE}\nWhat?"}], image)
    assert other.choices[0].message.content == expected[1]

    def counted() -> bool:
        values = metric_values(server.base_url)
        hits = values.get("kvflow:mm_encoder_cache_hits_total", 0.0)
        return hits == 1 and values["kvflow:mm_encoder_cache_queries_total"] == 2

    assert wait_for(counted, timeout_s=10.0), metric_values(server.base_url)

"""A tiny LLaVA served by `kvflow serve`, driven by the openai client: a chat message
with an image as a data: URL gives transformers' greedy tokens; a refused image is a 400
and the server keeps serving; the second turn with the same image hits the prefix cache,
and with other text before it, the encoder cache (kvflow:mm_encoder_cache_hits_total).
With --data-parallel-size 2, chats with images get one engine's answers and spread over
both engines."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from llava_fixture import make_llava_dir, random_image
from serve_harness import (
    MODEL_NAME,
    Server,
    by_engine,
    metric_values,
    start_server,
    stop_server,
    wait_for,
)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a real serve of a vision model (~4 processes)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    return make_llava_dir(tmp_path_factory.mktemp("llava"), embedded_model_dir, 28)


LIMITS = ["--limit-mm-per-prompt", '{"image": 2}', "--block-size", "4"]
DP2 = ["--data-parallel-size", "2", "--load-balance", "round-robin"]


@pytest.fixture(scope="module")
def server(llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(llava_dir, tmp_path_factory.mktemp("serve"), *LIMITS)
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


def hf_greedy(path: Path, messages: list[dict[str, Any]], image: Any) -> tuple[int, str]:
    """(prompt length, greedy text) of transformers on the chat as kvflow renders it:
    the parts joined by newlines, the image part as the model's image token."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(path))
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=[image], return_tensors="pt", add_special_tokens=False)
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    length = inputs["input_ids"].shape[1]
    return length, processor.tokenizer.decode(out[0, length:], skip_special_tokens=True)


def _image_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_chat(url: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]
    return [{"role": "user", "content": parts}]


def test_chat_with_a_data_url_image(server: Server, llava_dir: Path) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    image = random_image(5, 64, 48)
    chat = _image_chat(_image_url(image))

    def ask(*before: dict[str, str]) -> Any:
        return client.chat.completions.create(
            model=MODEL_NAME,
            messages=[*before, *chat],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )

    first = ask()
    length, text = hf_greedy(llava_dir, [{"role": "user", "content": "<image>\nWhat?"}], image)
    assert first.usage.prompt_tokens == length
    assert first.choices[0].message.content == text
    with pytest.raises(openai.BadRequestError, match="allowed-media-domains"):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
                    ],
                }
            ],
            max_tokens=2,
        )
    again = ask()  # still serving; the same image and text share the KV of the first
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # Other text before the same image: its KV is computed again, its features are not.
    ask({"role": "system", "content": "Be brief."})

    def counted() -> bool:
        values = metric_values(server.base_url)
        hits = values.get("kvflow:mm_encoder_cache_hits_total", 0.0)
        return hits == 1 and values["kvflow:mm_encoder_cache_queries_total"] == 2

    assert wait_for(counted, timeout_s=10.0), metric_values(server.base_url)


def test_data_parallel_serves_images_like_one_engine(
    server: Server, llava_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Six chats, each with its own image, sent at once to two engines (round-robin: the
    default prefix-aware policy keeps them on the engine that holds their shared chat
    template): one engine's answers, and both engines serve some."""
    urls = [_image_url(random_image(20 + i, 40 + 8 * i, 48)) for i in range(6)]
    dp = start_server(llava_dir, tmp_path_factory.mktemp("dp"), *LIMITS, *DP2)
    try:

        def answers(base_url: str) -> list[str | None]:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)

            def ask(url: str) -> str | None:
                reply = client.chat.completions.create(
                    model=MODEL_NAME, messages=_image_chat(url), max_tokens=MAX_TOKENS,
                    temperature=0.0, extra_body={"ignore_eos": True},
                )  # fmt: skip
                return reply.choices[0].message.content

            with ThreadPoolExecutor(len(urls)) as pool:
                return list(pool.map(ask, urls))

        assert answers(dp.base_url) == answers(server.base_url)
        served = by_engine(dp.base_url, "kvflow:request_success_total")
        assert sorted(served) == ["0", "1"] and all(served.values()), served
    finally:
        code, survivors = stop_server(dp)
    assert survivors == [] and code == 0, dp.log_tail()

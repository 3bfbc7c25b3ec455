"""`kvflow bench serve --random-image-size`: chat payloads with a random PNG image each,
and the chat stream timed from its first content chunk (not the role chunk)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
from typing import Any

import httpx
import pytest

from kvflow.bench import image_requests, request_client
from kvflow.bench.datasets import SampleRequest


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def _args(**overrides: Any) -> argparse.Namespace:
    values = dict(endpoint="/v1/completions", random_image_size=(48, 32), seed=3, ignore_eos=True)
    return argparse.Namespace(**{**values, **overrides})


def test_each_request_gets_its_own_image_as_a_chat_message() -> None:
    from PIL import Image

    requests = [SampleRequest([1, 2], 2, 5), SampleRequest([3], 1, 7)]
    args = _args()
    payloads = image_requests.make_payloads(args, "m", requests, _Tokenizer())
    assert args.endpoint == "/v1/chat/completions"
    urls = []
    for payload, request in zip(payloads, requests):
        image, text = payload["messages"][0]["content"]
        assert text == {"type": "text", "text": _Tokenizer().decode(request.prompt)}  # type: ignore[arg-type]
        assert payload["max_tokens"] == request.expected_output_len and payload["ignore_eos"]
        url = image["image_url"]["url"]
        data = base64.b64decode(url.removeprefix("data:image/png;base64,"))
        assert Image.open(io.BytesIO(data)).size == (48, 32)
        urls.append(url)
    assert urls[0] != urls[1]
    again = image_requests.make_payloads(_args(), "m", requests, _Tokenizer())
    assert again == payloads  # the same seed, the same images


def test_endpoints_and_sizes_are_checked() -> None:
    with pytest.raises(SystemExit):  # chat without images: nothing to send as messages
        image_requests.make_payloads(
            _args(random_image_size=None, endpoint="/v1/chat/completions"), "m", [], None
        )
    for bad in ("448", "0x4", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            image_requests.parse_size(bad)
    assert image_requests.parse_size("448X320") == (448, 320)


def test_chat_stream_times_from_the_first_content_chunk() -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": "b"}}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go() -> request_client.RequestOutput:
        async with httpx.AsyncClient(transport=transport) as client:
            return await request_client.send_request(client, "http://x/v1/chat/completions", {}, 2)

    output = asyncio.run(go())
    assert output.success and output.generated_text == "ab" and output.output_tokens == 2
    assert len(output.itl) == 1  # two content chunks: the role chunk is not one

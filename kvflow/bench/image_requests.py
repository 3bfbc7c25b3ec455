"""Image requests for `kvflow bench serve --random-image-size WxH` (a vision model).

Each request becomes one chat message: a random image (seeded noise of the given size,
a PNG `data:` URL, so the server fetches nothing) followed by the request's prompt as
text (its token ids decoded), sent to /v1/chat/completions (streamed, greedy, with
usage). The server runs the model's processor, so the image costs what the model makes
of it (e.g. 729 features for a 384-pixel SigLIP tower); `prompt_len` counts the text.

Any OpenAI-compatible server with the model's chat template serves it (kvflow, vLLM).
"""

from __future__ import annotations

import argparse
import base64
import io
from typing import Any

import numpy as np

from kvflow.bench import request_client
from kvflow.bench.datasets import SampleRequest

CHAT_ENDPOINT = "/v1/chat/completions"


def parse_size(text: str) -> tuple[int, int]:
    """`--random-image-size`: WxH, e.g. 448x448."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        width = height = 0
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"bad image size {text!r} (e.g. 448x448)")
    return width, height


def random_image_url(rng: np.random.Generator, size: tuple[int, int]) -> str:
    from PIL import Image

    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_payload(
    model: str, text: str, image_url: str, max_tokens: int, ignore_eos: bool
) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": text},
    ]
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def make_payloads(
    args: argparse.Namespace, model: str, requests: list[SampleRequest], tokenizer: Any
) -> list[dict[str, Any]]:
    """The run's request bodies: completions, or chat messages with an image each
    (--random-image-size; the endpoint then defaults to chat completions)."""
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if args.random_image_size is None:
        if chat:
            raise SystemExit("kvflow bench serve: chat completions only with --random-image-size")
        return [request_client.completion_payload(model, r, args.ignore_eos) for r in requests]
    if not chat:
        args.endpoint = CHAT_ENDPOINT
    rng = np.random.default_rng(args.seed)
    payloads = []
    for request in requests:
        prompt = request.prompt
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        url = random_image_url(rng, args.random_image_size)
        max_tokens = request.expected_output_len
        payloads.append(chat_payload(model, text, url, max_tokens, args.ignore_eos))
    return payloads


def add_args(data: Any) -> None:
    data.add_argument(
        "--random-image-size",
        type=parse_size,
        default=None,
        metavar="WxH",
        help="one random image of this size per request, as chat messages (vision models)",
    )

"""Chat image parts refused with a 400 in OpenAI's error shape, before anything reaches
the engine, while the server keeps serving: against the fake engine of
test_frontend_app.py (real sockets, a real uvicorn server), once as a vision model's
frontend (a tiny LLaVA's processor) and once as a text-only one. Also kvflow/media.py's
decoding on its own: the formats, and a huge image refused from its header."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llava_fixture import make_llava_dir, random_image
from test_frontend_app import MODEL, Harness, start_harness

from kvflow.errors import InvalidRequestError
from kvflow.image_inputs import ImageLimits
from kvflow.media import MediaOptions, decode_image, load_image

LIMITS = ImageLimits(max_images=2, max_pixels=1 << 20)


def data_url(image: Any, fmt: str = "PNG", mime: str = "image/png") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels and holds none (an IHDR and an IEND)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


GOOD = data_url(random_image(0, 20, 20))
BOMB = "data:image/png;base64," + base64.b64encode(png_header(25_000, 20_000)).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Iterator[Harness]:
    llava = make_llava_dir(tmp_path_factory.mktemp("llava"), embedded_model_dir, 28)
    media = MediaOptions(allowed_local_media_path=str(llava), limits=LIMITS)
    harness = start_harness(
        tmp_path_factory.mktemp("ipc"), media=media, vision_model_dir=str(llava)
    )
    harness.vision_key = (media, str(llava))  # type: ignore[attr-defined]
    yield harness
    harness.stop()


def test_the_processor_is_loaded_before_the_first_request(vision: Harness) -> None:
    from kvflow.services.frontend.chat_images import chat_images

    # build_app loaded it (not the event loop on the first image): this is a cache hit.
    hits = chat_images.cache_info().hits
    loaded = chat_images(*vision.vision_key)  # type: ignore[attr-defined]
    assert loaded.prompter is not None and chat_images.cache_info().hits == hits + 1


@pytest.mark.parametrize(
    ("parts", "words"),
    [
        ([image_part("data:image/png;base64,@@not-base64@@")], "does not decode"),
        ([image_part("data:text/plain;base64,aGVsbG8=")], "unsupported image type"),
        ([image_part("data:image/png;base64,aGVsbG8=")], "not a PNG, JPEG or WebP"),
        ([image_part(BOMB)], "exceeds the limit"),
        ([image_part(GOOD)] * 3, "the limit is 2"),
        ([image_part("https://example.com/cat.png")], "--allowed-media-domains"),
        ([image_part("file:///etc/hostname")], "--allowed-local-media-path"),
        ([image_part("ftp://example.com/cat.png")], "data:, http(s)"),
    ],
    ids=["base64", "mime", "not-image", "huge-header", "too-many", "remote", "local", "scheme"],
)
def test_bad_image_is_a_400(vision: Harness, parts: list[dict[str, Any]], words: str) -> None:
    added = len(vision.fake.added)
    response = vision.post("/v1/chat/completions", chat(*parts))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["param"] == "messages"
    assert len(vision.fake.added) == added, "a refused request must not reach the engine"
    text = vision.post("/v1/chat/completions", chat())  # the server keeps serving
    assert text.status_code == 200, text.text


def test_image_part_to_text_only_model_is_a_400(tmp_path: Path) -> None:
    harness = start_harness(tmp_path)
    try:
        response = harness.post("/v1/chat/completions", chat(image_part(GOOD)))
        assert response.status_code == 400, response.text
        assert "text only" in response.json()["error"]["message"]
        assert harness.post("/v1/chat/completions", chat()).status_code == 200
    finally:
        harness.stop()


@pytest.mark.parametrize(
    ("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")]
)
def test_data_urls_of_each_format_decode(fmt: str, mime: str) -> None:
    image = load_image(data_url(random_image(1, 30, 20), fmt, mime), MediaOptions())
    assert image.size == (30, 20) and image.mode == "RGB"


def test_mime_must_match_the_data_and_local_files_load_under_the_allowed_path(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidRequestError, match="not image/jpeg"):
        load_image(data_url(random_image(2, 8, 8), "PNG", "image/jpeg"), MediaOptions())
    random_image(3, 12, 10).save(tmp_path / "cat.png")  # type: ignore[attr-defined]
    options = MediaOptions(allowed_local_media_path=str(tmp_path))
    assert load_image(f"file://{tmp_path}/cat.png", options).size == (12, 10)
    with pytest.raises(InvalidRequestError, match="outside"):
        load_image(f"file://{tmp_path}/../x.png", options)


def test_huge_header_is_refused_before_decoding() -> None:
    # Below PIL's own decompression-bomb threshold: our limit decides, from the header.
    with pytest.raises(InvalidRequestError, match="exceeds the limit"):
        decode_image(png_header(4000, 4000), "image/png", ImageLimits(max_pixels=1 << 20))


def test_offline_chat_parts_render_as_the_servers_and_keep_their_order() -> None:
    from kvflow.offline.chat_messages import split_images

    image_a, image_b = random_image(1, 8, 8), random_image(2, 8, 8)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": image_a},
                {"type": "text", "text": "vs"},
                {"type": "image_url", "image_url": {"url": data_url(image_b)}},
            ],
        },
    ]
    messages, images = split_images(conversation, "<image>", MediaOptions())
    assert messages == [conversation[0], {"role": "user", "content": "<image>\nvs\n<image>"}]
    assert [i.tobytes() for i in images] == [image_a.tobytes(), image_b.tobytes()]  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError, match="text only"):
        split_images(conversation, None, MediaOptions())
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/a.png"}]}]
    with pytest.raises(InvalidRequestError, match="allowed-media-domains"):
        split_images(remote, "<image>", MediaOptions())


def test_the_web_ui_offers_images_only_for_a_vision_model(vision: Harness, tmp_path: Path) -> None:
    """The playground shows its image input when /ui/config says the model reads images
    (the browser test: tests/ui/test_web_ui_images.py)."""
    assert vision.http.get("/ui/config").json() == {"images": True, "max_images": 2}
    page = vision.http.get("/").text
    assert 'id="image-input"' in page and 'accept="image/png,image/jpeg,image/webp"' in page
    text_only = start_harness(tmp_path, api_key="k")
    try:
        assert text_only.http.get("/ui/config").status_code == 401  # behind the API key
        config = text_only.http.get("/ui/config", headers={"Authorization": "Bearer k"})
        assert config.json() == {"images": False, "max_images": 0}
    finally:
        text_only.stop()

"""Where a chat message's image may come from, and decoding it safely.

- `data:` URLs (base64 PNG, JPEG or WebP) are always taken.
- http(s) URLs are fetched only from the hosts `--allowed-media-domains` lists (a
  server that fetches any URL a client names can be made to reach its own network:
  SSRF); redirects are not followed, the body is capped and the fetch times out.
- Local files (`file://` URLs) only under `--allowed-local-media-path`.

Every image's size is checked from its header, before its pixels are decoded, so a
small file claiming 500 megapixels costs nothing. Each refusal is an
InvalidRequestError (a 400 in OpenAI's error shape).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.errors import InvalidRequestError
from kvflow.image_inputs import ImageLimits

IMAGE_MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
MAX_FETCH_BYTES = 32 << 20
PARAM = "messages"


@dataclass(frozen=True)
class MediaOptions:
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) images may come from
    allowed_local_media_path: str | None = None  # a directory file:// images may come from
    limits: ImageLimits = ImageLimits()
    fetch_timeout_s: float = 5.0


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=PARAM)


def load_image(url: str, options: MediaOptions) -> Any:
    """The PIL image (RGB) an image_url names; raises InvalidRequestError."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(*_data_url(url), options.limits)
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, options), None, options.limits)
    if scheme == "file":
        return decode_image(_local_file(url, options), None, options.limits)
    raise _refuse("image_url must be a data:, http(s):// or file:// URL")


def _data_url(url: str) -> tuple[bytes, str]:
    header, sep, payload = url[len("data:") :].partition(",")
    mime, _, encoding = header.partition(";")
    if not sep or encoding.lower() != "base64":
        raise _refuse("a data: image URL must be base64 (data:image/png;base64,...)")
    mime = mime.strip().lower()
    if mime not in IMAGE_MIME_TYPES:
        raise _refuse(f"unsupported image type {mime!r}; send one of {sorted(IMAGE_MIME_TYPES)}")
    try:
        return base64.b64decode(payload, validate=True), mime
    except (binascii.Error, ValueError):
        raise _refuse("the image's base64 data does not decode") from None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect could lead to a host the list does not allow


def _fetch(url: str, options: MediaOptions) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in {d.lower() for d in options.allowed_media_domains}:
        raise _refuse(
            f"this server does not fetch images from {host or url!r}: send the image as a "
            "data: URL, or start the server with --allowed-media-domains listing the host"
        )
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(url, timeout=options.fetch_timeout_s) as response:
            data: bytes = response.read(MAX_FETCH_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise _refuse(f"fetching the image failed: {exc}") from None
    if len(data) > MAX_FETCH_BYTES:
        raise _refuse(f"the image at {url!r} is larger than {MAX_FETCH_BYTES} bytes")
    return data


def _local_file(url: str, options: MediaOptions) -> bytes:
    root = options.allowed_local_media_path
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if root is None or not path.is_relative_to(Path(root).resolve()):
        raise _refuse(
            "this server does not read local image files outside --allowed-local-media-path"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise _refuse(f"the image file does not read: {exc.strerror}") from None


def decode_image(data: bytes, mime: str | None, limits: ImageLimits) -> Any:
    """PNG/JPEG/WebP bytes -> an RGB PIL image, its size checked before its pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise _refuse(f"the image exceeds the limit of {limits.max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise _refuse("the image data is not a PNG, JPEG or WebP image") from None
    if image.format not in IMAGE_MIME_TYPES.values():
        raise _refuse(f"unsupported image format {image.format!r} (PNG, JPEG or WebP)")
    if mime is not None and IMAGE_MIME_TYPES[mime] != image.format:
        raise _refuse(f"the data is a {image.format} image, not {mime}")
    limits.check_size(*image.size)
    try:
        return image.convert("RGB")  # decodes the pixels
    except (OSError, ValueError, Image.DecompressionBombError):
        raise _refuse("the image data is truncated or corrupt") from None

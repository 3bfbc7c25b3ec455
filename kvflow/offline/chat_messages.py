"""LLM.chat's messages: image content parts taken out, as the server takes them.

A message's content may be a list of parts: `{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": ...}}` (a data: URL; http(s) and file://
are refused unless the media options allow them, as for a server) or
`{"type": "image_pil", "image_pil": <PIL image>}`. The parts are rendered for the chat
template by the server's own message type (text joined by newlines, an image as the
model's image token), and the images come back in the order the conversation shows them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.media import MediaOptions, load_image
from kvflow.services.frontend.protocol import ChatMessage

# What an image part becomes for the message type: its URL is not read again.
_IMAGE_PART = {"type": "image_url", "image_url": {"url": ""}}


def split_images(
    conversation: list[dict[str, Any]], image_token: str | None, options: MediaOptions
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages for the chat template, their PIL images in order). `image_token`
    None: a text-only model, which refuses image parts."""
    messages: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)  # a text message goes to the template as it is
            continue
        parts = []
        for part in content:
            if not _is_image(part):
                parts.append(part)
                continue
            parts.append(_IMAGE_PART)  # a text-only model refuses it (to_dict below)
            if image_token is not None:
                images.append(_load(part, options))
        try:
            parsed = msgspec.convert({**message, "content": parts}, ChatMessage)
        except msgspec.ValidationError as e:
            raise InvalidRequestError(f"a chat message: {e}", param="messages") from e
        messages.append({**message, **parsed.to_dict(image_token)})
    return messages, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")


def _load(part: dict[str, Any], options: MediaOptions) -> Any:
    """The image part's PIL image (RGB)."""
    if part["type"] == "image_pil":
        return part["image_pil"].convert("RGB")
    url = part.get("image_url")
    return load_image(url["url"] if isinstance(url, dict) else str(url), options)

"""A prompt's images in the model's own preprocessing, as the engine takes them.

The prompt holds the model's image token once per image (`<image>` for LLaVA), in
order. `ImagePrompter.expand` runs the model's image processor (AutoProcessor from the
model directory: resize, crop, rescale, normalize as its preprocessor config says),
replaces each image token by the run of placeholders the model fills with that image's
features, and describes each image for the wire (proto/multimodal.py): its pixels, its
run and a hash of its pixels (the encoder cache's and the prefix cache's key).

The frontend and the offline engine both call it, so a served prompt and an offline one
give the same tokens. Limits (images per prompt, pixels per image) are checked here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvflow.errors import InvalidRequestError
from kvflow.proto.multimodal import MAX_IMAGE_BYTES, ImageInput, MRopePositions, PixelTensor

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per prompt (--limit-mm-per-prompt '{"image": N}')
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of one image

    @classmethod
    def from_mm_limits(cls, limits: dict[str, int] | None, max_pixels: int | None) -> ImageLimits:
        """From --limit-mm-per-prompt's mapping (only "image" is known) and a pixel cap."""
        limits = dict(limits or {})
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: unknown modalities {unknown} (image only)")
        return cls(
            max_images=int(limits.get("image", cls.max_images)),
            max_pixels=int(max_pixels or DEFAULT_MAX_IMAGE_PIXELS),
        )

    def check_size(self, width: int, height: int) -> None:
        """Refuse an image larger than the pixel cap (from its header, before decoding)."""
        if width * height > self.max_pixels:
            raise InvalidRequestError(
                f"an image of {width}x{height} pixels exceeds the limit of {self.max_pixels}",
                param="messages",
            )


def is_vision_model(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    return "vision_config" in config


class ExpandedPrompt(NamedTuple):
    token_ids: list[int]  # each image token expanded to its placeholder run
    images: list[ImageInput]  # for the wire
    mrope: MRopePositions | None  # M-RoPE models' positions (Qwen2.5-VL), else None


class Prompter(Protocol):
    """A vision model's preprocessing: `image_token` is what a chat message shows where
    an image part was; `expand` runs the preprocessing and expands the prompt."""

    image_token: str

    def expand(self, token_ids: list[int], images: list[Any]) -> ExpandedPrompt: ...


def make_image_prompter(model_dir: Path, limits: ImageLimits | None = None) -> Prompter:
    """The prompter of the model's family: Qwen2.5-VL's own preprocessing
    (kvflow/qwen_vl_images.py), or the model's AutoProcessor (LLaVA)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") == "qwen2_5_vl":
        from kvflow.qwen_vl_images import QwenVLImagePrompter

        return QwenVLImagePrompter(model_dir, limits)
    return ImagePrompter(model_dir, limits)


def check_image_marks(
    token_ids: list[int], images: list[Any], token_id: int, token: str, limits: ImageLimits
) -> list[int]:
    """The indices of the prompt's image tokens, one per image (else a 400)."""
    if len(images) > limits.max_images:
        raise InvalidRequestError(
            f"{len(images)} images in one prompt; the limit is {limits.max_images}",
            param="messages",
        )
    marks = [i for i, t in enumerate(token_ids) if t == token_id]
    if len(marks) != len(images):
        raise InvalidRequestError(
            f"the prompt has {len(marks)} image placeholders ({token!r}) for {len(images)} images"
        )
    return marks


class ImagePrompter:
    """The model's image preprocessing and placeholder expansion (module docstring)."""

    def __init__(self, model_dir: Path, limits: ImageLimits | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoProcessor

        config = json.loads((model_dir / "config.json").read_text())
        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        self.limits = limits or ImageLimits()
        self.image_processor = processor.image_processor
        self.image_token = str(processor.image_token)
        self.image_token_id = int(config["image_token_index"])
        self.patch_size = int(processor.patch_size or config["vision_config"]["patch_size"])
        strategy = config.get("vision_feature_select_strategy", "default")
        # LLaVA-1.5 drops the class token ("default"); "full" keeps it.
        self.extra_tokens = int(processor.num_additional_image_tokens) - (strategy == "default")

    def expand(self, token_ids: list[int], images: list[Any]) -> ExpandedPrompt:
        """The prompt with each image token expanded and the images for the wire;
        `images` are PIL images, one per image token of the prompt, in order."""
        marks = check_image_marks(
            token_ids, images, self.image_token_id, self.image_token, self.limits
        )
        if not images:
            return ExpandedPrompt(token_ids, [], None)
        for image in images:
            self.check_size(image)
        pixels = self.image_processor(images, return_tensors="np")["pixel_values"]
        out: list[int] = []
        inputs: list[ImageInput] = []
        previous = 0
        for mark, image_pixels in zip(marks, pixels):
            height, width = image_pixels.shape[-2:]
            count = (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens
            out += token_ids[previous:mark]
            inputs.append(image_input(np.asarray(image_pixels, dtype="<f4"), len(out), count))
            out += [self.image_token_id] * count
            previous = mark + 1
        out += token_ids[previous:]
        return ExpandedPrompt(out, inputs, None)

    def check_size(self, image: Any) -> None:
        width, height = image.size
        self.limits.check_size(width, height)


def image_input(
    pixels: np.ndarray, offset: int, length: int, grid_thw: list[int] | None = None
) -> ImageInput:
    """One image for the wire: raw little-endian bytes, hashed with dtype, shape and
    patch grid (the same rows as another grid are another image)."""
    data = np.ascontiguousarray(pixels).tobytes()
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"an image's pixels exceed {MAX_IMAGE_BYTES} bytes")
    dtype, shape, grid = pixels.dtype.name, list(pixels.shape), list(grid_thw or [])
    digest = hashlib.sha256(f"{dtype}{shape}{grid if grid else ''}".encode())
    digest.update(data)
    return ImageInput(digest.hexdigest(), offset, length, PixelTensor(dtype, shape, data), grid)

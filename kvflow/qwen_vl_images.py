"""Qwen2.5-VL's image preprocessing and placeholder expansion, numpy and PIL only.

The model directory's `preprocessor_config.json` (Qwen2VL image processor) gives the
patch size p, the merge size m, the temporal patch size tp, the pixel bounds and the
normalization. Each image is:

    resized to h x w, both multiples of p*m, near its own size and aspect with
      min_pixels <= h*w <= max_pixels (`smart_resize`), bicubic
    -> rescaled to [0, 1] and normalized per channel
    -> cut into (h/p) x (w/p) patches of p x p, each repeated tp times in time (a still
       image is tp identical frames), in merge-block order: the m x m patches that
       the tower merges into one token are consecutive rows
    -> pixels [(h/p)*(w/p), C*tp*p*p] with grid_thw (1, h/p, w/p)

The prompt holds `<|vision_start|><|image_pad|><|vision_end|>` per image (as the chat
template writes it); its one `<|image_pad|>` becomes (h/p)*(w/p)/m^2 of them. The M-RoPE
positions of the expanded prompt are computed once here (kvflow/mrope.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.image_inputs import ExpandedPrompt, ImageLimits, check_image_marks, image_input
from kvflow.mrope import mrope_positions

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_PAD = "<|image_pad|>"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(h, w): multiples of `factor`, closest to the image's, within the pixel bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height}: aspect ratio over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class QwenVLImageProcessor:
    """preprocessor_config.json's fields, and one image -> (patch rows, grid_thw)."""

    def __init__(self, config: dict[str, Any]) -> None:
        size = config.get("size") or {}
        self.min_pixels = int(config.get("min_pixels") or size.get("shortest_edge", 56 * 56))
        self.max_pixels = int(config.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280))
        self.patch = int(config.get("patch_size", 14))
        self.merge = int(config.get("merge_size", 2))
        self.temporal = int(config.get("temporal_patch_size", 2))
        self.scale = float(config.get("rescale_factor", 1 / 255))
        self.mean = np.asarray(config.get("image_mean", CLIP_MEAN), dtype=np.float32)
        self.std = np.asarray(config.get("image_std", CLIP_STD), dtype=np.float32)

    def __call__(self, image: Any) -> tuple[np.ndarray, list[int]]:
        from PIL import Image

        factor = self.patch * self.merge
        h, w = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        rgb = image.convert("RGB").resize((w, h), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(rgb, dtype=np.float32) * np.float32(self.scale)  # [h, w, C]
        pixels = ((pixels - self.mean) / self.std).transpose(2, 0, 1)  # [C, h, w]
        p, m, channels = self.patch, self.merge, pixels.shape[0]
        gh, gw = h // p, w // p
        blocks = pixels.reshape(channels, gh // m, m, p, gw // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
        frames = np.broadcast_to(
            blocks[:, :, :, :, :, None], (*blocks.shape[:5], self.temporal, p, p)
        )
        rows = frames.reshape(gh * gw, channels * self.temporal * p * p)
        return np.ascontiguousarray(rows, dtype="<f4"), [1, gh, gw]


class QwenVLImagePrompter:
    """ImagePrompter's interface for Qwen2.5-VL (kvflow/image_inputs.py)."""

    image_token = PLACEHOLDER  # what a chat message shows where an image part was

    def __init__(self, model_dir: Path, limits: ImageLimits | None = None) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.limits = limits or ImageLimits()
        self.image_token_id = int(config["image_token_id"])
        self.processor = QwenVLImageProcessor(
            json.loads((model_dir / "preprocessor_config.json").read_text())
        )

    def expand(self, token_ids: list[int], images: list[Any]) -> ExpandedPrompt:
        marks = check_image_marks(token_ids, images, self.image_token_id, IMAGE_PAD, self.limits)
        if not images:
            return ExpandedPrompt(token_ids, [], None)
        out: list[int] = []
        inputs = []
        previous = 0
        for mark, image in zip(marks, images):
            self.limits.check_size(*image.size)
            pixels, grid = self.processor(image)
            count = pixels.shape[0] // self.processor.merge**2
            out += token_ids[previous:mark]
            inputs.append(image_input(pixels, len(out), count, grid))
            out += [self.image_token_id] * count
            previous = mark + 1
        out += token_ids[previous:]
        return ExpandedPrompt(out, inputs, mrope_positions(len(out), inputs, self.processor.merge))

"""Image features at their placeholder rows: a runner feature, with an encoder cache.

Each step, for every scheduled request whose tokens overlap an image's placeholder run,
the feature takes that image's features (from the cache, or by running the vision
encoder on the images the step misses, as one batch) and hands the model the rows of
the step's flattened tokens they replace. A chunk that covers part of a run gets the
matching slice, so chunked prefill may split an image anywhere.

The cache is keyed by the image's hash (its pixels), least recently used out first
within a byte budget, so a later turn with the same image is not encoded again. A step
with image rows runs eagerly: a decode graph replays token embeddings only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from kvflow.errors import InvalidRequestError
from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.multimodal import MAX_IMAGE_BYTES, ImageInput, PixelTensor
from kvflow.proto.step import StepPlan

logger = logging.getLogger(__name__)

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


def pixels_to_tensor(pixels: PixelTensor) -> torch.Tensor:
    """The wire's raw bytes as a tensor, checked against the size cap and the shape."""
    if len(pixels.data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"an image's pixels exceed {MAX_IMAGE_BYTES} bytes")
    dtype = np.dtype(pixels.dtype).newbyteorder("<")
    if dtype.kind != "f" or int(np.prod(pixels.shape)) * dtype.itemsize != len(pixels.data):
        raise InvalidRequestError(f"image pixels {pixels.dtype}{pixels.shape} do not match")
    array = np.frombuffer(pixels.data, dtype=dtype).reshape(pixels.shape)
    return torch.from_numpy(array.astype(np.float32))


class EncoderCache:
    """image hash -> features [placeholders, hidden]; LRU within `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return features

    def put(self, key: str, features: torch.Tensor) -> None:
        if key in self._entries:
            return
        self._entries[key] = features
        self._bytes += features.numel() * features.element_size()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()


def _eager(cache: torch.Tensor) -> None:
    """A per-layer callback that does nothing: its presence keeps the step eager."""


class ImageFeature(StepFeature):
    def __init__(self, model: torch.nn.Module, device: torch.device, cache: EncoderCache) -> None:
        self.model = model
        self.device = device
        self.cache = cache
        self._images: dict[str, list[ImageInput]] = {}  # requests with runs still to compute
        self._active = False
        # Images placed (their run's first row this step) and those of them found in
        # the cache, since the last take_counts: the engine's encoder-cache metrics.
        # Counted per image, not per chunk, so a run split by chunked prefill counts once.
        self.num_queries = 0
        self.num_hits = 0
        self.num_encoded = 0  # features the encoder computed (the scheduler's budget)

    def on_plan(self, plan: StepPlan) -> None:
        self._set(None, None)  # a failed step's rows must never reach a later one
        for req_id in plan.finished_req_ids:
            self._images.pop(req_id, None)
        for new in plan.new_requests:
            if new.images:
                self._images[new.req_id] = new.images

    def before_forward(self, plan: StepPlan) -> None:
        if not self._images:
            return
        starts = {new.req_id: new.num_computed_tokens for new in plan.new_requests}
        starts.update((c.req_id, c.num_computed_tokens) for c in plan.cached_requests)
        wanted: list[tuple[int, ImageInput, int, int]] = []  # (first row, image, lo, hi)
        row = 0
        for req_id, count in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            images = self._images.get(req_id)
            if images:
                start = starts[req_id]
                for image in images:
                    lo = max(start, image.offset) - image.offset
                    hi = min(start + count, image.offset + image.length) - image.offset
                    if lo < hi:
                        wanted.append((row + image.offset + lo - start, image, lo, hi))
                if start + count >= images[-1].offset + images[-1].length:
                    del self._images[req_id]  # its prefill is past its last image
            row += count
        if wanted:
            self._place(wanted)

    def _place(self, wanted: list[tuple[int, ImageInput, int, int]]) -> None:
        features, encoded = self._features([image for _, image, _, _ in wanted])
        for _, image, lo, _ in wanted:
            if lo == 0:  # the image's first rows: one lookup of it
                self.num_queries += 1
                if image.hash in encoded:
                    encoded.discard(image.hash)  # a second copy this step reuses it
                else:
                    self.num_hits += 1
        rows = [torch.arange(first, first + hi - lo) for first, _, lo, hi in wanted]
        parts = [features[image.hash][lo:hi] for _, image, lo, hi in wanted]
        self._set(torch.cat(rows).to(self.device), torch.cat(parts))

    def _features(self, images: list[ImageInput]) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Each image's features: from the cache, or encoded (the misses in one batch
        per pixel shape and patch grid); and the hashes encoded."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageInput] = {}
        for image in images:
            if image.hash in found or image.hash in missing:
                continue
            cached = self.cache.get(image.hash)
            if cached is None:
                missing[image.hash] = image
            else:
                found[image.hash] = cached
        by_shape: dict[tuple[int, ...], list[ImageInput]] = {}
        for image in missing.values():
            by_shape.setdefault((*image.pixels.shape, *image.grid_thw), []).append(image)
        encode: Callable[[torch.Tensor, list[int]], torch.Tensor] = self.model.encode_images  # type: ignore[assignment]
        for group in by_shape.values():
            pixels = torch.stack([pixels_to_tensor(i.pixels) for i in group]).to(self.device)
            for image, out in zip(group, encode(pixels, group[0].grid_thw)):
                if out.shape[0] != image.length:
                    raise InvalidRequestError(
                        f"an image gives {out.shape[0]} features for {image.length} placeholders"
                    )
                self.cache.put(image.hash, out)
                self.num_encoded += image.length
                found[image.hash] = out
        return found, set(missing)

    def take_counts(self) -> tuple[int, int, int]:
        """(queries, hits, features encoded) since the last call."""
        counts = (self.num_queries, self.num_hits, self.num_encoded)
        self.num_queries = self.num_hits = self.num_encoded = 0
        return counts

    def _set(self, rows: torch.Tensor | None, features: torch.Tensor | None) -> None:
        self.model.set_image_embeddings(rows, features)  # type: ignore[operator]
        self._active = rows is not None

    def layer_hook(self, plan: StepPlan) -> AfterLayer | None:
        return _eager if self._active else None

    def after_step(
        self, plan: StepPlan, inputs: object, logits: torch.Tensor, result: object
    ) -> None:
        self._set(None, None)

    def clear(self) -> None:
        self._images.clear()
        self._set(None, None)


def make_image_feature(model: torch.nn.Module, device: torch.device) -> ImageFeature | None:
    """The feature for a model that reads images (one with `encode_images`), else None."""
    if not hasattr(model, "encode_images"):
        return None
    return ImageFeature(model, device, EncoderCache())

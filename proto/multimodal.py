"""Images on the wire: preprocessed pixels as raw bytes, never pickle.

The frontend (or the offline engine) runs the model's own image processor and sends
each image's pixel tensor with where its placeholder tokens sit in the prompt. The
scheduler passes them to the worker with the request (`NewRequestData.images`); the
worker encodes them and puts the features at the placeholder positions.
"""

from __future__ import annotations

import msgspec

# One image's pixels may not exceed this on any socket (a 4-tile 448x448 float32 image
# is ~9.6 MB); the receiver checks it before it builds a tensor.
MAX_IMAGE_BYTES = 64 << 20


class PixelTensor(msgspec.Struct, array_like=True, gc=False):
    """A C-contiguous little-endian tensor: `dtype` is a numpy name ("float32")."""

    dtype: str
    shape: list[int]
    data: bytes


class ImageInput(msgspec.Struct, array_like=True, gc=False):
    """One image of a prompt: its pixels and its placeholder run
    prompt[offset : offset + length] (the tokens its features replace)."""

    hash: str  # sha256 of the pixels (hex): the encoder cache's and prefix cache's key
    offset: int
    length: int
    pixels: PixelTensor
    # Qwen2.5-VL: the patch grid (temporal, height, width) the flat patch rows of
    # `pixels` [t*h*w, C*tp*p*p] form; empty for a model whose pixels carry their shape.
    grid_thw: list[int] = []


class MRopePositions(msgspec.Struct, array_like=True, gc=False):
    """A prompt's M-RoPE positions (Qwen2.5-VL), computed once where it is expanded
    (kvflow/mrope.py): `data` is int32 little-endian [3, num_prompt_tokens], the
    (temporal, height, width) rows; a token past the prompt at index i has position
    i + delta on all three rows."""

    delta: int
    data: bytes

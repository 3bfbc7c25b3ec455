"""M-RoPE positions of a prompt with images (Qwen2.5-VL's multimodal rotary positions).

Every token gets three positions (temporal, height, width). A text token's three are
equal and count on from the token before it; an image's placeholder run, an h x w grid
of merged patches (t = 1), starts at the next position s and places merged patch (i, j)
at (s, s + i, s + j); the text after it continues from s + max(h, w)::

    tokens     T T [v v v v v v] T T        an image of 2 x 3 merged patches
    temporal   0 1  2 2 2 2 2 2  5 6
    height     0 1  2 2 2 3 3 3  5 6
    width      0 1  2 3 4 2 3 4  5 6

So positions run behind token indices; `delta` (max position + 1 - prompt length,
<= 0) is how far: the token at index i >= prompt length (generated) sits at i + delta.
Computed once per prompt here, where its images are expanded; the worker reads slices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.proto.multimodal import ImageInput, MRopePositions


def mrope_positions(num_tokens: int, images: Sequence[ImageInput], merge: int) -> MRopePositions:
    """The positions of a prompt of `num_tokens` whose image runs are `images` (in
    order, with their patch grids); `merge`: patches per merged patch along a side."""
    table = np.empty((3, num_tokens), dtype=np.int64)
    index = 0  # next token
    position = 0  # its position, if text
    for image in images:
        text = image.offset - index
        table[:, index : image.offset] = np.arange(position, position + text)
        position += text
        t, h, w = image.grid_thw
        h, w = h // merge, w // merge
        if t * h * w != image.length:
            raise ValueError(f"an image grid {image.grid_thw} for {image.length} placeholders")
        grid = np.indices((t, h, w)).reshape(3, -1)  # [3, t*h*w], row-major as the tower
        table[:, image.offset : image.offset + image.length] = grid + position
        position += max(t, h, w)
        index = image.offset + image.length
    table[:, index:] = np.arange(position, position + num_tokens - index)
    delta = int(table.max(initial=-1)) + 1 - num_tokens
    return MRopePositions(delta, np.ascontiguousarray(table, dtype="<i4").tobytes())


def positions_array(positions: MRopePositions) -> np.ndarray:
    """[3, num_prompt_tokens] int64 of the wire's buffer."""
    return np.frombuffer(positions.data, dtype="<i4").reshape(3, -1).astype(np.int64)

"""Where a vision-language model's image features enter its language model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def with_image_embeddings(
    embed: Callable[[torch.Tensor], torch.Tensor] | None,
    input_ids: torch.Tensor,
    image_rows: tuple[torch.Tensor, torch.Tensor] | None,
    received: Any,
) -> Any:
    """What the decoder's first layer starts from: the token embeddings with the image
    features [R, hidden] written at their rows [R]. The decoder takes them as a later
    pipeline stage takes what it received, with no residual yet. `received` (a later
    stage's input) or a step without images passes through unchanged."""
    if received is not None or image_rows is None:
        return received
    assert embed is not None, "a stage that embeds tokens has the embedding"
    rows, features = image_rows
    hidden = embed(input_ids)
    return (hidden.index_copy(0, rows, features.to(hidden.dtype)), None)

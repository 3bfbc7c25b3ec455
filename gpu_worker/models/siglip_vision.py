"""The SigLIP vision tower (LLaVA's other image encoder), plain torch.

SigLIP differs from CLIP (clip_vision.py) only around the layers: no class token, no
layer norm before them, and a patch convolution with a bias. The encoder layers are
CLIP's (same names, same pre-norm blocks)::

    pixels [N, 3, S, S] -> conv (patch p, stride p, bias) -> [N, (S/p)^2, D]
      -> + positions -> hidden_states[0] -> layer i -> hidden_states[i]

`post_layernorm` and the attention-pooling `head` follow the last layer in HF's
`SiglipVisionModel`; LLaVA reads a layer's hidden states before either (HF returns
hidden_states[-1] before the post-layernorm), so the head's weights are not loaded
and the post-layernorm is kept only because checkpoints carry it. HF's names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.models.clip_vision import ClipEncoder, select_hidden_states


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, kernel_size=patch, stride=patch
        )
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(
                f"{patches.shape[1]} patches for {self.position_embedding.num_embeddings} "
                "learned positions: images must be resized to the tower's image_size"
            )
        return patches + self.position_embedding.weight  # type: ignore[no-any-return]


class SiglipVisionTower(nn.Module):
    """HF's SiglipVisionModel weights: embeddings, encoder.layers, post_layernorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = ClipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """hidden_states[i] for each i of `indices` (negative: from the end), each
        [N, P, D]; runs only the layers needed."""
        return select_hidden_states(self.embeddings(pixels), self.encoder.layers, indices)

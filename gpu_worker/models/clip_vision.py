"""The CLIP vision tower (LLaVA's image encoder), plain torch: no KV cache, no paging.

An image is cut into patches, each patch embedded, a class token put in front and
learned positions added; then pre-norm transformer layers with full attention::

    pixels [N, 3, S, S] -> conv (patch p, stride p) -> [N, (S/p)^2, D]
      -> [cls, patches] + positions -> pre_layrnorm -> hidden_states[0]
      -> layer i -> hidden_states[i]       (LLaVA reads one of these, not the last)

Only the layers up to the one the caller reads are run. HF's parameter names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.cpu.prefill_attention import full_attention


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,  # Qwen2.5-VL's tower (qwen_vision.py)
}


def activation(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class ClipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, kernel_size=patch, stride=patch, bias=False
        )
        num_positions = (config.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        tokens = torch.cat([cls, patches], dim=1)  # [N, 1 + P, D]
        return tokens + self.position_embedding.weight[: tokens.shape[1]]


class ClipAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = full_attention(q, k, v)  # scale D^-0.5
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class ClipMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # type: ignore[no-any-return]


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = ClipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))  # type: ignore[no-any-return]


class ClipEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ClipEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )


class ClipVisionTower(nn.Module):
    """HF's CLIPVisionModel weights: embeddings, pre_layrnorm, encoder.layers, post_layernorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = ClipVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ClipEncoder(config)
        # Not read by LLaVA (it takes a layer's hidden states), kept for the checkpoint.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """hidden_states[i] for each i of `indices` (negative: from the end, as in HF's
        list of num_layers + 1 states), each [N, 1 + P, D]; runs only the layers needed."""
        first = self.pre_layrnorm(self.embeddings(pixels))
        return select_hidden_states(first, self.encoder.layers, indices)


def select_hidden_states(
    first: torch.Tensor, layers: nn.ModuleList, indices: list[int]
) -> list[torch.Tensor]:
    """HF's hidden_states[i] (0: `first`, i: after layer i) for each i of `indices`
    (negative: from the end of the num_layers + 1 states); runs only the layers needed."""
    count = len(layers) + 1
    wanted = [i % count for i in indices]
    states = {0: first}
    x = first
    for i, layer in enumerate(layers[: max(wanted)], 1):
        x = layer(x)
        states[i] = x
    return [states[i] for i in wanted]

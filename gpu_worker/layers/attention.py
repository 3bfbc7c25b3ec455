"""The attention layer: owns one layer's KV cache view and calls the attention backend.

`kv_cache` is a plain attribute, not a buffer: it is not part of the state dict, is not
moved by `.to()`, and stays an empty tensor until the model runner binds this layer's
view `[2, num_blocks, block_size, num_kv_heads, head_dim]` of the shared cache tensor,
with `kv_group`, the KV cache group whose block tables address it (kvflow/kv_groups.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.attn_metadata import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # attention logits capped to (-softcap, softcap) (Gemma 2)
        self.backend = backend
        self.kv_cache = torch.empty(0)
        self.kv_group = 0  # its KV cache group (kvflow/kv_groups.py), set with kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KH, D] -> [T, H * D]; must run inside forward_context()."""
        context = get_forward_context()
        out = self.backend.forward(
            q,
            k,
            v,  # a view of the fused projection: the backends take its row stride
            self.kv_cache,
            context.attn_metadata.of_group(self.kv_group),
            self.scale,
            self.sliding_window,
            self.softcap,
        )  # [T, H, D]
        if context.after_layer is not None:  # this layer's K/V are in the cache now
            context.after_layer(self.kv_cache)
        return out.view(-1, self.num_heads * self.head_dim)

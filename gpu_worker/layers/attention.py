"""The attention layer: owns one layer's KV cache view and calls the attention backend.

`kv_cache` is a plain attribute, not a buffer: it is not part of the state dict, is not
moved by `.to()`, and stays an empty tensor until the model runner binds this layer's
view `[2, num_blocks, block_size, num_kv_heads, head_dim]` of the shared cache tensor,
with `kv_group`, the KV cache group whose block tables address it (kvflow/kv_groups.py).

Options on the logits: a sliding window, a soft-cap (Gemma 2) and attention sinks
(gpt-oss: a learned logit per query head in the softmax's denominator, see
attention/softcap.py). The sinks are this layer's parameter `sinks` [num_heads], this
tensor-parallel rank's heads of the checkpoint's [total heads].
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.attn_metadata import get_forward_context
from kvflow.gpu_worker.layers.linear import copy_checked, new_parameter
from kvflow.gpu_worker.parallel_state import get_tp_group


class Attention(nn.Module):
    kv_planes = 2  # K and V (an MLA layer caches 1 latent plane: layers/mla.py)

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
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
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = new_parameter((num_heads,), self._load_sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """The checkpoint's sinks of every head -> this rank's heads."""
        start = get_tp_group().rank * self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] < start + self.num_heads:
            raise ValueError(f"sinks of shape {tuple(loaded.shape)} for {self.num_heads} heads")
        copy_checked(param.data, loaded.narrow(0, start, self.num_heads))

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
            self.sinks,
        )  # [T, H, D]
        if context.after_layer is not None:  # this layer's K/V are in the cache now
            context.after_layer(self.kv_cache)
        return out.view(-1, self.num_heads * self.head_dim)

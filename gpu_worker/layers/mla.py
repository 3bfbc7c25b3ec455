"""The multi-head latent attention layer (DeepSeek-V2/V3): owns one layer's latent
cache view and calls the attention backend's MLA path.

Like `Attention` (layers/attention.py), `kv_cache` is a plain attribute that the model
runner binds, here to a view `[1, num_blocks, block_size, 1, kv_lora_rank + rope]` of
the shared cache (kv_cache.py's 1-plane layout). To the code that sizes caches and
captures graphs the layer reads as one KV head of `head_dim` = the latent row's width,
the width of the absorbed queries too (attention/mla_torch.py).

Backends: the Triton one runs it in its paged kernel (`forward_latent`); the torch and
cpu ones run attention/mla_torch.py's torch ops (the native CPU kernels have no MLA
variant), with the torch backend's step plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.attention.mla_torch import latent_attention
from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attn_metadata import get_forward_context
from kvflow.gpu_worker.layers.linear import copy_checked, new_parameter
from kvflow.gpu_worker.parallel_state import divide, get_tp_group


class LatentUpProjection(nn.Module):
    """kv_b_proj: W [H (N + V), r] that expands a latent into every head's k_nope | v,
    split by heads over tensor-parallel ranks. Kept a plain parameter (not a linear
    layer, whose weight the CPU packing frees): MLA reads it per head, as [H, N + V, r]."""

    def __init__(self, kv_lora_rank: int, num_heads: int, head_width: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_heads, self.head_width = divide(num_heads, self.tp.size), head_width
        rows = self.num_heads * head_width
        self.weight = new_parameter((rows, kv_lora_rank), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        rows = param.shape[0]
        copy_checked(param.data, loaded.narrow(0, self.tp.rank * rows, rows))

    def per_head(self) -> torch.Tensor:
        """[H_local, N + V, r]."""
        return self.weight.view(self.num_heads, self.head_width, -1)


class MLAAttention(nn.Module):
    """Attention of `num_heads` heads over one cached latent row per token."""

    kv_planes = 1  # the cache layout (kv_cache.py): one latent row, no separate V
    num_kv_heads = 1
    sliding_window = None
    softcap = None
    sinks = None
    kv_group = 0  # latent layers are full attention: group 0 (kvflow/kv_groups.py)

    def __init__(
        self, num_heads: int, latent_width: int, scale: float, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = latent_width  # kv_lora_rank + qk_rope_head_dim
        self.scale = scale
        self.backend = backend
        # The torch path's step plans: the backend's own, or (Triton) its unbound fallback.
        self.plans = backend if isinstance(backend, TorchAttentionBackend) else None
        self.kv_cache = torch.empty(0)

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_pe: torch.Tensor,  # [T, H, R], rotated
        latent: torch.Tensor,  # [T, 1, r + R]: normed c_kv | rotated k_pe
        kv_b: torch.Tensor,  # [H, N + V, r]
    ) -> torch.Tensor:  # [T, H * V]
        context = get_forward_context()
        md = context.attn_metadata
        if self.plans is not None:
            out = latent_attention(
                self.plans, q_nope, q_pe, latent, kv_b, self.kv_cache, md, self.scale
            )
        else:
            forward_latent = self.backend.forward_latent  # type: ignore[attr-defined]
            out = forward_latent(q_nope, q_pe, latent, kv_b, self.kv_cache, md, self.scale)
        if context.after_layer is not None:  # this layer's latents are in the cache now
            context.after_layer(self.kv_cache)
        return out.reshape(out.shape[0], -1)

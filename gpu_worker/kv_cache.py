"""KV cache sizing and allocation: one tensor, one view per layer (no fragmentation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_hf_config(cls, hf_config: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            num_layers=hf_config.num_hidden_layers,
            block_size=block_size,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            dtype=dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    """Per-layer views `[2, num_blocks, block_size, num_kv_heads, head_dim]` of one tensor."""
    # On CPU, `empty` maps fresh pages that the OS zero-fills on first touch, so start-up
    # does not spend ~0.8 s writing 2 GiB of zeros; on CUDA a memset is nearly free and
    # keeps recycled device memory (possibly NaN bit patterns) out of the cache.
    alloc = torch.empty if device.type == "cpu" else torch.zeros
    cache = alloc(
        spec.num_layers,
        2,
        num_blocks,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        dtype=spec.dtype,
        device=device,
    )
    return list(cache.unbind(0))

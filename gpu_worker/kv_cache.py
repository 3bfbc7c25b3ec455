"""KV cache sizing and allocation: one tensor, one view per layer (no fragmentation).

A cache holds the model dtype, or with `--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2` the
8-bit rows of kernels/kv_codec.py: head_dim codes and a float32 scale per (token, kv
head), `head_dim + 4` elements of one byte each. Everything here counts elements of the
storage dtype per row (`kv_codec.row_width`), so sizing, allocation and block transfer
treat both kinds alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import resolve_kv_cache_dtype
from kvflow.kernels import kv_codec

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in _FLOAT_DTYPES.items()}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a `--kv-cache-dtype` name (resolved or not)."""
    name = resolve_kv_cache_dtype(kv_cache_dtype, _DTYPE_NAMES[model_dtype])
    return kv_codec.CODEC_DTYPES.get(name) or _FLOAT_DTYPES[name]


@dataclass(frozen=True)
class KVCacheSpec:
    # Cache tensors: one per layer, or with a hybrid KV cache one per layer of a group,
    # each shared by one layer of every group (kvflow/kv_groups.py), so that a block id
    # holds `num_layers` layers' K/V whichever group holds it.
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the storage dtype: the model's, or a kv_codec 8-bit one

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
    def quantized(self) -> bool:
        return kv_codec.is_quantized(self.dtype)

    @property
    def row_width(self) -> int:
        """Elements of one (token, kv head) row: head_dim, + 4 scale bytes if quantized."""
        return kv_codec.row_width(self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V of every cache tensor (layer, or layer of a group) for one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * elem


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    """Per-layer views `[2, num_blocks, block_size, num_kv_heads, row_width]` of one tensor."""
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
        spec.row_width,
        dtype=spec.dtype,
        device=device,
    )
    return list(cache.unbind(0))

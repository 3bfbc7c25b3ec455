"""KV cache sizing and allocation: one tensor, one view per layer (no fragmentation).

A cache holds the model dtype, or with `--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2` the
8-bit rows of kernels/kv_codec.py: head_dim codes and a float32 scale per (token, kv
head), `head_dim + 4` elements of one byte each. Everything here counts elements of the
storage dtype per row (`kv_codec.row_width`), so sizing, allocation and block transfer
treat both kinds alike.

Two layouts of a layer's cache, by `KVCacheSpec.planes` (the cache's first dim):

    planes 2  K and V   [2, num_blocks, block_size, num_kv_heads, head_dim]   every MHA/GQA family
    planes 1  latent    [1, num_blocks, block_size, 1, kv_lora_rank + rope]   multi-head latent
                                                                              attention (DeepSeek)

An MLA layer caches one compressed row per token: the normed latent c_kv that both K
and V are decompressed from, then the rotated RoPE key shared by every head
(gpu_worker/attention/mla.py). Blocks of either layout index and travel alike
(dim 1 is the block), so sizing and block transfer need nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import resolve_kv_cache_dtype
from kvflow.errors import ConfigError
from kvflow.gpu_worker import host_memory
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
    planes: int = 2  # 2: K and V; 1: an MLA latent row per token (module docstring)

    @classmethod
    def from_hf_config(cls, hf_config: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        layers = hf_config.num_hidden_layers
        latent = getattr(hf_config, "kv_lora_rank", None)
        if latent is not None:  # MLA: the latent c_kv and the shared RoPE key, one "head"
            if kv_codec.is_quantized(dtype):
                raise ConfigError(
                    "--kv-cache-dtype with an 8-bit cache is not available for multi-head "
                    "latent attention (DeepSeek-V2/V3): its cache already holds one "
                    "compressed row per token; use --kv-cache-dtype auto"
                )
            width = latent + hf_config.qk_rope_head_dim
            return cls(layers, block_size, num_kv_heads=1, head_dim=width, dtype=dtype, planes=1)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            num_layers=layers,
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
    def bytes_per_token(self) -> int:
        """One token's cache rows over every cache tensor (a layer, or a layer of each group
        of a hybrid cache): K and V, or the MLA latent."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.planes * self.num_layers * self.num_kv_heads * self.row_width * elem

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    """Per-layer views `[planes, num_blocks, block_size, num_kv_heads, row_width]` of one
    tensor."""
    # On CPU the pages are reserved (host_memory.py: checked against the free memory,
    # faulted in now, huge where the kernel agrees), not zeroed by a write; on CUDA a
    # memset is nearly free and keeps recycled device memory (possibly NaN bit patterns)
    # out of the cache.
    if device.type == "cpu":
        host_memory.check_fits(
            num_blocks * spec.bytes_per_block, "the KV cache", "--kv-cache-memory"
        )
    alloc = torch.empty if device.type == "cpu" else torch.zeros
    cache = alloc(
        spec.num_layers,
        spec.planes,
        num_blocks,
        spec.block_size,
        spec.num_kv_heads,
        spec.row_width,
        dtype=spec.dtype,
        device=device,
    )
    host_memory.reserve(cache)
    return list(cache.unbind(0))

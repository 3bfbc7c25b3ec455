"""Write this step's key/value vectors into the paged KV cache.

Cache layout (one tensor per layer)::

    kv_cache[0 | 1, block, offset, kv_head, d]      0 = K, 1 = V
    slot s  ->  block s // block_size, offset s % block_size

One program stores one token (all of its KV heads, K and V); a token whose slot is -1 is
padding (e.g. a CUDA-graph filler) and is skipped, so it never overwrites a live block.

Into a quantized cache (kernels/kv_codec.py) the same program quantizes each (token, KV
head) row on the way: the row's amax gives its scale, the codes and the scale's 4 bytes
are written as one row of head_dim + 4 bytes, bit for bit what `kv_codec.quantize_rows`
computes (kernels/kv_codec_triton.py). Nothing is staged through another buffer and no
host sync is needed, so the store stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels import kv_codec
from kvflow.kernels.kv_codec_triton import FLOAT, codec_id, encode_rows, kernel_view, scale_bytes
from kvflow.kernels.launch_utils import (
    assert_last_dim_contiguous,
    check_device,
    next_pow2,
)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 if quantized)]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    KV_CODEC: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)  # [HEADS_P]
    offs_d = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    src_k = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    row = block * stride_c_block + offset * stride_c_slot + offs_h * stride_c_head  # [HEADS_P]
    dst = row[:, None] + offs_d[None, :]  # [HEADS_P, HEAD_DIM_P]
    key = tl.load(key_ptr + src_k, mask=mask)
    value = tl.load(value_ptr + src_v, mask=mask)
    if KV_CODEC == FLOAT:
        tl.store(cache_ptr + dst, key, mask=mask)
        tl.store(cache_ptr + stride_c_kv + dst, value, mask=mask)
    else:
        scale_dst = row[:, None] + head_dim + tl.arange(0, 4)[None, :]  # [HEADS_P, 4]
        scale_mask = offs_h[:, None] < num_kv_heads
        _store_rows(cache_ptr + dst, cache_ptr + scale_dst, key, mask, scale_mask, KV_CODEC)
        c_v = cache_ptr + stride_c_kv
        _store_rows(c_v + dst, c_v + scale_dst, value, mask, scale_mask, KV_CODEC)


@triton.jit
def _store_rows(code_ptrs, scale_ptrs, x, mask, scale_mask, KV_CODEC: tl.constexpr):
    """Quantize rows `x` [HEADS_P, HEAD_DIM_P] and write their codes and scale bytes."""
    codes, scale = encode_rows(x.to(tl.float32), mask, KV_CODEC)
    tl.store(code_ptrs, codes, mask=mask)
    tl.store(scale_ptrs, scale_bytes(scale), mask=scale_mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4)]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Copy key[t] / value[t] into kv_cache at slot_mapping[t]; slots < 0 are skipped.
    A quantized cache gets the rows quantized (kv_codec's format)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    width = kv_codec.row_width(head_dim, kv_cache.dtype)
    assert kv_cache.shape[3:] == (num_kv_heads, width), (kv_cache.shape, key.shape)
    assert key.dtype == value.dtype, (key.dtype, value.dtype)
    assert key.dtype == kv_cache.dtype or kv_codec.is_quantized(kv_cache.dtype), kv_cache.dtype
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        assert_last_dim_contiguous(name, t)
    check_device(_store_kv_kernel, key, value, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kernel_view(kv_cache),
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_P=next_pow2(num_kv_heads),
        HEAD_DIM_P=next_pow2(head_dim),
        KV_CODEC=codec_id(kv_cache.dtype),
    )


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Reference (the spec): scatter each non-padding token's K/V to its slot, as
    `kv_codec.quantize_rows` rows if the cache is quantized."""
    block_size = kv_cache.shape[2]
    if kv_codec.is_quantized(kv_cache.dtype):
        key, value = (kv_codec.quantize_rows(x, kv_cache.dtype) for x in (key, value))
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[0, slot // block_size, slot % block_size] = key[t]
        kv_cache[1, slot // block_size, slot % block_size] = value[t]

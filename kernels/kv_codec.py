"""The quantized KV cache format: 8-bit codes per element, one float32 scale per row.

A quantized cache holds, per layer, `[2, num_blocks, block_size, kv_heads, head_dim + 4]`
elements of the codec's storage dtype (torch.int8, torch.float8_e4m3fn or
torch.float8_e5m2: the tensor's dtype names its codec). Each (token, kv head) row is

    | head_dim codes | float32 scale, 4 bytes little-endian |

and stands for `float(code) * scale`. The scale is the row's max |x| over the codec's
largest code (127, 448, 57344), so no row saturates and each keeps its own range. A
per-row scale costs 4 of 68 bytes at head_dim 64 and makes a calibration pass (or a
checkpoint's per-tensor scales) unnecessary. The trailing scale keeps a row, a block
and a layer one contiguous piece of one tensor: paging, prefix caching and block
transfer handle a quantized cache exactly like a float one.

This module is the reference (torch ops, any device). Kernels that read or write the
format natively are tested against it.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4

# storage dtype -> the largest code magnitude the quantizer produces
_QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

# --kv-cache-dtype names of the quantized formats -> storage dtype
CODEC_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, kv head) row of a cache of this storage dtype."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim of a cache or of rows gathered from it (last dim is the row)."""
    return row_width_to_head_dim(cache.shape[-1], cache.dtype)


def row_width_to_head_dim(width: int, dtype: torch.dtype) -> int:
    return width - SCALE_BYTES if is_quantized(dtype) else width


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` [..., head_dim] (any float dtype) as rows [..., head_dim + 4] of `dtype`."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / qmax  # [..., 1]
    # An all-zero row keeps scale 0: its codes are 0 and decode to 0 exactly.
    scaled = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if dtype == torch.int8:
        codes = scaled.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-qmax, qmax).to(dtype)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    raw = rows.view(torch.uint8)
    raw[..., : x.shape[-1]] = codes.view(torch.uint8)
    raw[..., x.shape[-1] :] = scale.view(torch.uint8)
    return rows


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [..., head_dim + 4] of a quantized cache as values [..., head_dim]."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    values = rows[..., :head_dim].float() * scale
    return values.to(out_dtype)

"""Rotary position embedding applied in place to query and key.

`cos_sin_cache[pos]` holds `rot_dim // 2` cosines then `rot_dim // 2` sines for position
pos. The first rot_dim dims of each head are rotated (partial rotary leaves the rest);
rotation pair i is, per layout::

    neox (rotate halves):    (x[i], x[i + rot_dim/2])      Llama, Qwen, Mistral in HF
    interleaved (GPT-J):     (x[2i], x[2i + 1])

    (a, b) -> (a cos_i - b sin_i,  b cos_i + a sin_i)      computed in fp32

With `round_products` each product is rounded to the activation dtype before the sum is
(and the sum again): what Hugging Face's `q * cos + rotate_half(q) * sin` does in bf16 or
fp16, and the model's torch and CPU paths with it, bit for bit. `rotary_embedding_tables`
takes per-token tables (the model's `Rope`, row t for token t) instead of a position-indexed
cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.launch_utils import (
    FLOAT_DTYPES,
    assert_last_dim_contiguous,
    check_device,
    next_pow2,
    round_to,
)


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's [num_heads, head_dim] rows
    stride_h,
    num_heads,
    cos,  # [HALF_P] fp32
    sin,  # [HALF_P] fp32
    offs_r,  # [HALF_P]
    mask_r,  # [HALF_P]
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HEADS_P: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_P)
    mask = (offs_h[:, None] < num_heads) & mask_r[None, :]  # [HEADS_P, HALF_P]
    if IS_NEOX:
        first = offs_r
        second = offs_r + HALF
    else:
        first = 2 * offs_r
        second = 2 * offs_r + 1
    ptr_a = base_ptr + offs_h[:, None] * stride_h + first[None, :]
    ptr_b = base_ptr + offs_h[:, None] * stride_h + second[None, :]
    a = tl.load(ptr_a, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ptr_b, mask=mask, other=0.0).to(tl.float32)
    dtype = base_ptr.dtype.element_ty
    if ROUND_PRODUCTS:  # each product rounded first: no fused multiply-add can form
        new_a = round_to(
            round_to(a * cos[None, :], dtype) - round_to(b * sin[None, :], dtype), dtype
        )
        new_b = round_to(
            round_to(b * cos[None, :], dtype) + round_to(a * sin[None, :], dtype), dtype
        )
    else:
        new_a = round_to(a * cos[None, :] - b * sin[None, :], dtype)  # [HEADS_P, HALF_P]
        new_b = round_to(b * cos[None, :] + a * sin[None, :], dtype)
    tl.store(ptr_a, new_a.to(dtype), mask=mask)
    tl.store(ptr_b, new_b.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_k_heads, head_dim], rotated in place
    cos_ptr,  # [max_position, rot_dim / 2] rows of stride stride_cs
    sin_ptr,  # [max_position, rot_dim / 2] rows of stride stride_cs
    positions_ptr,  # [num_tokens] int64; unread without BY_POSITION (row t: token t)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    Q_HEADS_P: tl.constexpr,
    K_HEADS_P: tl.constexpr,
    BY_POSITION: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if BY_POSITION:
        pos = tl.load(positions_ptr + token)
    else:
        pos = token
    offs_r = tl.arange(0, HALF_P)
    mask_r = offs_r < HALF
    cos = tl.load(cos_ptr + pos * stride_cs + offs_r, mask=mask_r, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cs + offs_r, mask=mask_r, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, offs_r, mask_r,
                  HALF=HALF, IS_NEOX=IS_NEOX, HEADS_P=Q_HEADS_P,
                  ROUND_PRODUCTS=ROUND_PRODUCTS)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, cos, sin, offs_r, mask_r,
                  HALF=HALF, IS_NEOX=IS_NEOX, HEADS_P=K_HEADS_P,
                  ROUND_PRODUCTS=ROUND_PRODUCTS)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], modified in place
    key: torch.Tensor,  # [num_tokens, num_k_heads, head_dim], modified in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    is_neox: bool = True,
) -> None:
    """Rotate the first rot_dim dims of every head of query and key by its position."""
    assert positions.shape == (query.shape[0],) and positions.dtype == torch.int64
    assert cos_sin_cache.shape[1] % 2 == 0, cos_sin_cache.shape
    half = cos_sin_cache.shape[1] // 2
    _launch(query, key, cos_sin_cache[:, :half], cos_sin_cache[:, half:], positions,
            is_neox=is_neox, round_products=False)  # fmt: skip


def rotary_embedding_tables(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], modified in place
    key: torch.Tensor,  # [num_tokens, num_k_heads, head_dim], modified in place
    cos: torch.Tensor,  # [num_tokens, rot_dim / 2]: token t's row t
    sin: torch.Tensor,  # [num_tokens, rot_dim / 2]
    round_products: bool = True,
) -> None:
    """Neox rotation of the first rot_dim dims of each head by per-token tables."""
    assert cos.shape == sin.shape and cos.shape[0] == query.shape[0], (cos.shape, sin.shape)
    _launch(query, key, cos, sin, None, is_neox=True, round_products=round_products)


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,  # [rows, rot_dim / 2]
    sin: torch.Tensor,  # [rows, rot_dim / 2], cos's row stride
    positions: torch.Tensor | None,  # [num_tokens] int64: cos/sin row of each token
    is_neox: bool,
    round_products: bool,
) -> None:
    num_tokens, num_q_heads, head_dim = query.shape
    rot_dim = 2 * cos.shape[1]
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, (key.shape, query.shape)
    assert rot_dim <= head_dim and sin.stride(0) == cos.stride(0), (rot_dim, head_dim)
    assert query.dtype == key.dtype and query.dtype in FLOAT_DTYPES, (query.dtype, key.dtype)
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        assert_last_dim_contiguous(name, t)
    tables = (cos, sin) if positions is None else (cos, sin, positions)
    check_device(_rotary_kernel, query, key, *tables)
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        query, key, cos, sin, cos if positions is None else positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0),
        num_q_heads, key.shape[1],
        HALF=rot_dim // 2, HALF_P=next_pow2(rot_dim // 2), IS_NEOX=is_neox,
        Q_HEADS_P=next_pow2(num_q_heads), K_HEADS_P=next_pow2(key.shape[1]),
        BY_POSITION=positions is not None, ROUND_PRODUCTS=round_products,
    )  # fmt: skip


def rope_cos_sin_cache(
    rot_dim: int, max_position: int, base: float, device: torch.device | str = "cpu"
) -> torch.Tensor:  # [max_position, rot_dim] fp32
    """Plain RoPE table: angle(pos, i) = pos * base^(-2i / rot_dim)."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], modified in place
    key: torch.Tensor,  # [num_tokens, num_k_heads, head_dim], modified in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    is_neox: bool = True,
) -> None:
    """Reference (the spec), see the module docstring."""
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cos = cos_sin_cache[positions, :half].float()[:, None, :]  # [num_tokens, 1, half]
    sin = cos_sin_cache[positions, half:].float()[:, None, :]
    for x in (query, key):
        rot = x[..., :rot_dim].float()
        a, b = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
        new_a, new_b = a * cos - b * sin, b * cos + a * sin
        if is_neox:
            rotated = torch.cat([new_a, new_b], dim=-1)
        else:
            rotated = torch.stack([new_a, new_b], dim=-1).flatten(-2)
        x[..., :rot_dim] = rotated.to(x.dtype)

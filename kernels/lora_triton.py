"""The LoRA terms of a mixed batch in Triton (CUDA; tested under TRITON_INTERPRET=1).

BGMV: every program takes one row and reads that row's adapter slot, so rows of any
adapters (and base rows, slot -1, which return at once) mix in one launch::

    shrink  grid (T, cdiv(S*R, BLOCK_N))   s[t, j] = sum_k x[t, k] * A[slot_t, j, k]   (fp32)
    expand  grid (T, cdiv(N, BLOCK_O))     y[t, o] += sum_r s[t, slice(o)*R + r] * B[slot_t, r, o]

`col_slice [N]` says which packed slice (q|k|v, gate|up) each output column is in. The
reference is kernels/lora.py's `lora_add_reference`.
"""

from __future__ import annotations

from collections.abc import Sequence

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
def _lora_shrink_kernel(
    s_ptr,  # [T, SR] fp32
    x_ptr,  # [T, K]
    a_ptr,  # [L, SR, K]
    slots_ptr,  # [T] int32
    stride_x,
    K,
    SR,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        mask = (offs_n[:, None] < SR) & (offs_k[None, :] < K)
        a = tl.load(
            a_ptr + (slot * SR + offs_n[:, None]) * K + offs_k[None, :], mask=mask, other=0.0
        )
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)  # [BLOCK_N]
    tl.store(s_ptr + row * SR + offs_n, acc, mask=offs_n < SR)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, N]
    s_ptr,  # [T, SR] fp32
    b_ptr,  # [L, R, N]
    slots_ptr,  # [T] int32
    col_slice_ptr,  # [N] int32
    stride_y,
    N,
    R,
    SR,
    BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)  # [BLOCK_O]
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask_o = offs_o < N
    mask = mask_o[:, None] & (offs_r[None, :] < R)
    part = tl.load(col_slice_ptr + offs_o, mask=mask_o, other=0).to(tl.int64)  # [BLOCK_O]
    s = tl.load(s_ptr + row * SR + part[:, None] * R + offs_r[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + (slot * R + offs_r[None, :]) * N + offs_o[:, None], mask=mask, other=0.0)
    delta = tl.sum(s * b.to(tl.float32), axis=1)  # [BLOCK_O]
    dtype = y_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    out = round_to(y + round_to(delta, dtype), dtype)
    tl.store(y_ptr + row * stride_y + offs_o, out.to(dtype), mask=mask_o)


def lora_add_triton(
    x: torch.Tensor,  # [T, K]
    y: torch.Tensor,  # [T, N], updated in place
    a: torch.Tensor,  # [L, S*R, K]
    b: torch.Tensor,  # [L, R, N]
    slices: Sequence[tuple[int, int]],
    row_slots: torch.Tensor,  # [T] int32, -1 = no adapter
) -> None:
    rows, k = x.shape
    rank, n = b.shape[1], b.shape[2]
    sr = a.shape[1]
    assert x.dtype in FLOAT_DTYPES and y.dtype == a.dtype == b.dtype == x.dtype
    assert a.shape[2] == k and sr == len(slices) * rank and y.shape == (rows, n)
    assert a.is_contiguous() and b.is_contiguous() and row_slots.dtype == torch.int32
    assert_last_dim_contiguous("x", x)
    assert_last_dim_contiguous("y", y)
    check_device(_lora_shrink_kernel, x, y, a, b, row_slots)
    if rows == 0:
        return
    col_slice = torch.empty(n, dtype=torch.int32, device=x.device)
    for i, (offset, size) in enumerate(slices):
        col_slice[offset : offset + size] = i
    shrunk = torch.empty(rows, sr, dtype=torch.float32, device=x.device)
    block_n, block_k = min(64, next_pow2(sr)), min(128, next_pow2(k))
    _lora_shrink_kernel[(rows, triton.cdiv(sr, block_n))](
        shrunk, x, a, row_slots, x.stride(0), k, sr, BLOCK_N=block_n, BLOCK_K=block_k
    )
    block_o = min(128, next_pow2(n))
    _lora_expand_kernel[(rows, triton.cdiv(n, block_o))](
        y, shrunk, b, row_slots, col_slice, y.stride(0), n, rank, sr,
        BLOCK_O=block_o, BLOCK_R=next_pow2(rank),
    )  # fmt: skip

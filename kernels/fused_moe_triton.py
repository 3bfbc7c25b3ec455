"""The fused experts on CUDA: two grouped GEMMs over the rows sorted by expert.

Same contract as the spec (`fused_experts_reference`, kernels/fused_moe_reference.py):
x [T, H], rows [N] (token of each sorted row), offsets [E+1] (expert e's sorted rows,
absolute), w13 [E, 2I, H], w2 [E, H, I] -> y [N, H].

    launch 1  act[s, n] = silu(x[rows[s]] . w13[e, n]) * (x[rows[s]] . w13[e, I + n])
    launch 2  y[s, n]   = act[s] . w2[e, n]

A program owns BLOCK_M sorted rows of one expert and BLOCK_N output columns. Which
expert and rows a program gets is worked out by torch on the device (`_block_plan`), so
nothing waits for the routing on the host (and CUDA graphs can capture it): each
expert's rows are cut into ceil(count / BLOCK_M) blocks, laid end to end; the grid has
the most blocks any routing can need, ceil(N / BLOCK_M) + E, and the spare programs
return at once.

    offsets = [0, 5, 5, 21], BLOCK_M = 16:  block 0 -> expert 0, rows 0..4
                                            block 1 -> expert 2, rows 5..20
                                            blocks 2.. -> none (return)

Rounding as the reference's: the gate and up products, silu, their product and y each
rounded to the dtype (kernels/launch_utils.py: `round_to`, and fp32 dot operands under
the interpreter).

Options (gpt-oss), as the reference's: biases b13 [E, 2I] and b2 [E, H] added to the
fp32 sums before their rounding, and the clamped SwiGLU (CLAMPED) in place of silu * up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.fused_moe_reference import ClampedSwiGLU
from kvflow.kernels.launch_utils import (
    FLOAT_DTYPES,
    check_device,
    dot_dtype,
    dot_precision,
    round_to,
)

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _activation(gate_acc, up_acc, alpha, limit, dtype: tl.constexpr, CLAMPED: tl.constexpr):
    """SiLU(gate) * up, or the clamped SwiGLU, of [BLOCK_M, BLOCK_N] fp32 accumulators,
    each op rounded to the output dtype where the unfused ops would round (the reference's
    order)."""
    gate = round_to(gate_acc, dtype)
    up = round_to(up_acc, dtype)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        scaled = round_to(gate * alpha, dtype)
        glu = round_to(gate * round_to(1.0 / (1.0 + tl.exp(-scaled)), dtype), dtype)
        return round_to(up + 1.0, dtype) * glu
    else:
        return round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up


@triton.jit
def _expert_tile_dots(
    a_ptr, a_rows, row_mask, stride_a, w_expert, cols, col_mask, out_cols, K,
    GLU: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One row block's [BLOCK_M, BLOCK_N] fp32 accumulators over K: x @ gate^T and (GLU)
    x @ up^T of one expert (`w_expert`: its [2 * out_cols or out_cols, K] weights)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_expert + cols[None, :] * K + ks[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(
            a.to(DOT_DTYPE), w.to(tl.float32).to(DOT_DTYPE), acc, input_precision=PRECISION
        )  # [BLOCK_M, BLOCK_N]
        if GLU:
            up_ptrs = w_expert + (out_cols + cols[None, :]) * K + ks[:, None]
            up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            up = up.to(tl.float32).to(DOT_DTYPE)
            acc_up = tl.dot(a.to(DOT_DTYPE), up, acc_up, input_precision=PRECISION)
    return acc, acc_up


@triton.jit
def _grouped_gemm_kernel(
    out_ptr,  # [N, out_cols]: act (GLU) or y
    a_ptr,  # GLU: x [T, K] read through rows; else act [N, K]
    rows_ptr,  # [N] int64: token of each sorted row (GLU only)
    w_ptr,  # [E, 2 * out_cols, K] (GLU: gate rows, then up rows) or [E, out_cols, K]
    offsets_ptr,  # [E + 1] int64: each expert's sorted rows
    bias_ptr,  # [E, 2 * out_cols] (GLU) or [E, out_cols] (HAS_BIAS)
    block_expert_ptr,  # [num_blocks] int64: the expert of each row block (>= E: none)
    block_row_ptr,  # [num_blocks] int64: its first sorted row
    num_experts,
    out_cols,
    K,
    stride_a,
    alpha,
    limit,
    GLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    dtype = out_ptr.dtype.element_ty
    row0 = tl.load(block_row_ptr + block)
    end = tl.load(offsets_ptr + expert + 1)
    rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted rows
    row_mask = rows < end
    if GLU:
        a_rows = tl.load(rows_ptr + rows, mask=row_mask, other=0)  # [BLOCK_M] tokens
    else:
        a_rows = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < out_cols
    w_rows = 2 * out_cols if GLU else out_cols
    w_expert = w_ptr + expert.to(tl.int64) * w_rows * K
    acc, acc_up = _expert_tile_dots(
        a_ptr, a_rows, row_mask, stride_a, w_expert, cols, col_mask, out_cols, K,
        GLU, DOT_DTYPE, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * w_rows + cols  # [BLOCK_N]
        acc += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            up_bias = tl.load(bias + out_cols, mask=col_mask, other=0.0).to(tl.float32)
            acc_up += up_bias[None, :]
    if GLU:
        acc = _activation(acc, acc_up, alpha, limit, dtype, CLAMPED)
    out = round_to(acc, dtype)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_cols + cols[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


def _block_plan(offsets: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first sorted row) of every row block the grid may run, on the device."""
    num_experts = offsets.shape[0] - 1
    counts = offsets.diff()
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    ends = blocks.cumsum(0)  # [E]: first block past each expert's
    grid = triton.cdiv(num_rows, BLOCK_M) + num_experts
    ids = torch.arange(grid, device=offsets.device)
    expert = torch.searchsorted(ends, ids, right=True)  # [grid], E where unused
    first = (ends - blocks)[expert.clamp(max=num_experts - 1)]
    row = offsets[:-1][expert.clamp(max=num_experts - 1)] + (ids - first) * BLOCK_M
    return expert, row


def fused_experts(
    x: torch.Tensor,  # [T, H], unit column stride
    rows: torch.Tensor,  # [N] int64
    offsets: torch.Tensor,  # [E + 1] int64
    w13: torch.Tensor,  # [E, 2I, H] contiguous
    w2: torch.Tensor,  # [E, H, I] contiguous
    *,
    b13: torch.Tensor | None = None,  # [E, 2I] contiguous, x's dtype
    b2: torch.Tensor | None = None,  # [E, H] contiguous
    clamped: ClampedSwiGLU | None = None,
) -> torch.Tensor:  # [N, H]: rows outside [offsets[0], offsets[E]) are zero
    num_experts, double, hidden = w13.shape
    inter = double // 2
    assert x.dtype in FLOAT_DTYPES and w13.dtype == w2.dtype == x.dtype, (x.dtype, w13.dtype)
    assert x.dim() == 2 and x.shape[1] == hidden and x.stride(1) == 1, (x.shape, x.stride())
    assert w13.is_contiguous() and w2.is_contiguous() and w2.shape == (num_experts, hidden, inter)
    assert offsets.shape == (num_experts + 1,) and rows.dtype == offsets.dtype == torch.int64
    check_device(_grouped_gemm_kernel, x, rows, offsets, w13, w2)
    for bias, shape in ((b13, (num_experts, double)), (b2, (num_experts, hidden))):
        if bias is not None:
            assert bias.shape == shape and bias.dtype == x.dtype and bias.is_contiguous()
            check_device(_grouped_gemm_kernel, x, bias)
    num_rows = rows.shape[0]
    y = torch.zeros(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_experts == 0:
        return y
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    expert, row = _block_plan(offsets, num_rows)
    dot = dot_dtype(_grouped_gemm_kernel, x.dtype)
    swiglu = clamped or ClampedSwiGLU()  # its numbers unused unless CLAMPED
    common = dict(
        CLAMPED=clamped is not None,
        DOT_DTYPE=dot,
        PRECISION=dot_precision(dot),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    rows = rows.contiguous()
    _grouped_gemm_kernel[(expert.shape[0], triton.cdiv(inter, BLOCK_N))](
        act, x, rows, w13, offsets, w13 if b13 is None else b13, expert, row, num_experts,
        inter, hidden, x.stride(0), swiglu.alpha, swiglu.limit, GLU=True,
        HAS_BIAS=b13 is not None, **common,
    )  # fmt: skip
    _grouped_gemm_kernel[(expert.shape[0], triton.cdiv(hidden, BLOCK_N))](
        y, act, rows, w2, offsets, w2 if b2 is None else b2, expert, row, num_experts, hidden,
        inter, act.stride(0), swiglu.alpha, swiglu.limit, GLU=False,
        HAS_BIAS=b2 is not None, **common,
    )  # fmt: skip
    return y

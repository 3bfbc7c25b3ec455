"""SiLU-and-mul, the gated MLP activation: out = silu(x[:, :I]) * x[:, I:].

Rounding follows torch on the activation dtype: silu is computed in fp32 and rounded,
then the product is computed in fp32 and rounded (what `F.silu(g) * u` does in bf16).
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

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, intermediate]
    x_ptr,  # [num_tokens, 2 * intermediate]: gate | up
    stride_o,
    stride_x,
    intermediate,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < intermediate
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + offs, mask=mask, other=0.0)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    out = round_to(silu * up.to(tl.float32), dtype)  # [BLOCK]
    tl.store(out_ptr + row * stride_o + offs, out.to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2I] -> [num_tokens, I]
    """silu(gate) * up for x = [gate | up] along the last dim."""
    num_tokens, double = x.shape
    assert double % 2 == 0 and x.dtype in FLOAT_DTYPES, (x.shape, x.dtype)
    assert_last_dim_contiguous("x", x)
    check_device(_silu_and_mul_kernel, x)
    intermediate = double // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    block = min(_MAX_BLOCK, next_pow2(intermediate))
    if num_tokens > 0:
        grid = (num_tokens, triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](
            out, x, out.stride(0), x.stride(0), intermediate, BLOCK=block
        )  # fmt: skip
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2I] -> [num_tokens, I]
    """Reference (the spec)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

"""RMSNorm and fused residual-add + RMSNorm (Llama-family semantics), with references.

Rounding follows the torch path of HF `LlamaRMSNorm` exactly: the sum of the residual
add is rounded to the activation dtype (it is what the next layer's residual holds) and
normalised from that rounded value; the normalised fp32 value is rounded to the
activation dtype before the weight multiply, whose product is rounded once more.
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

_MAX_HIDDEN = 1 << 16  # one program holds a whole row in registers


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    stride_o,
    stride_ro,
    stride_x,
    stride_r,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = round_to(x + residual.to(tl.float32), dtype)  # [BLOCK], what the stream holds
        tl.store(residual_out_ptr + row * stride_ro + offs, x.to(dtype), mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = round_to(x * inv_rms, dtype)  # [BLOCK]
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, round_to(normed * weight, dtype).to(dtype), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.dtype == x.dtype, (weight.shape, weight.dtype)
    assert x.dtype in FLOAT_DTYPES and hidden <= _MAX_HIDDEN, (x.dtype, hidden)
    assert_last_dim_contiguous("x", x)
    assert_last_dim_contiguous("weight", weight)
    check_device(_rms_norm_kernel, x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, residual.shape
        assert_last_dim_contiguous("residual", residual)
        new_residual = torch.empty_like(out)
    if num_tokens > 0:
        res_in = x if residual is None else residual  # placeholders when unused
        res_out = out if new_residual is None else new_residual
        _rms_norm_kernel[(num_tokens,)](
            out, res_out, x, res_in, weight,
            out.stride(0), res_out.stride(0), x.stride(0), res_in.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden),
        )  # fmt: skip
    return out, new_residual


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    """weight * (x / rms(x)), computed in fp32, rounded as in the module docstring."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new_residual: [num_tokens, hidden] each
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual)."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Reference (the spec): HF LlamaRMSNorm."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (the spec): the residual add in the activation dtype, then RMSNorm."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual

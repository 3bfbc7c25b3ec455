"""Launchers of the fused CPU elementwise kernels (elementwise.cpp): residual add +
RMSNorm, and SiLU(gate) * up. The torch references are the layers in
gpu_worker/layers/norm.py and activation.py, which call these when `applies` says so.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_bound(
        "elementwise",
        {
            "kvflow_rms_norm": [ctypes.c_int, *[POINTER] * 5, INT64, INT64, ctypes.c_float],
            "kvflow_silu_and_mul": [ctypes.c_int, POINTER, POINTER, INT64, INT64],
        },
    )


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these tensors: contiguous, on the CPU, one
    supported dtype (else the caller runs its torch ops)."""
    dtype = tensors[0].dtype
    return (
        dtype in DTYPE_CODES
        and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)
        and _library() is not None
    )


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"native {name} failed with status {status}")


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * weight, x + residual), or (norm(x) * weight, None)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    library = _library()
    assert library is not None, "call only where applies() is true"
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    _check(
        library.kvflow_rms_norm(
            DTYPE_CODES[x.dtype],
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            None if summed is None else summed.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // hidden,
            hidden,
            eps,
        ),
        "rms_norm",
    )
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
    library = _library()
    assert library is not None, "call only where applies() is true"
    d = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], d))
    _check(
        library.kvflow_silu_and_mul(
            DTYPE_CODES[x.dtype], x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d
        ),
        "silu_and_mul",
    )
    return out

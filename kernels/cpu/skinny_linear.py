"""Launcher of the native small-batch linear layer (skinny_linear.cpp).

`skinny_linear(x, weight, bias)` is F.linear for x of at most MAX_ROWS rows on the CPU
in float32 or bfloat16: the decode step of one or a few requests, where a linear layer
is one pass over its weights. Anything else goes to F.linear. The model's layers do not
call it directly: they call kernels/cpu/linear.py, which sends what `native_applies`
accepts to `run_native` and routes the rest (oneDNN for float32 batches).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound

MAX_ROWS = 8


@functools.cache
def _library() -> ctypes.CDLL | None:
    args = [ctypes.c_int, *[POINTER] * 4, *[INT64] * 4]
    return load_bound("skinny_linear", {"kvflow_skinny_linear": args})


def native_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel takes this call (else it is F.linear's)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype in DTYPE_CODES
        and weight.dtype == x.dtype
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and x.stride(1) == 1
        and weight.is_contiguous()
        and _library() is not None
    )


def skinny_linear(
    x: torch.Tensor,  # [rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [rows, out_features]
    if not native_applies(x, weight, bias):
        return F.linear(x, weight, bias)
    return run_native(x, weight, bias)


def run_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native kernel, for a call `native_applies` accepted."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    y = torch.empty(rows, out_features, dtype=x.dtype)
    library = _library()
    assert library is not None  # native_applies checked it
    status = native_calls.run(
        library.kvflow_skinny_linear,
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        in_features,
        out_features,
        x.stride(0),
    )
    if status != 0:
        raise RuntimeError(f"native skinny linear failed with status {status}")
    return y

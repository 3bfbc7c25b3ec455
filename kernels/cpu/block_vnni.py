"""GGUF blocks times int8 activations on AVX512-VNNI, for a few rows (block_vnni.cpp).

`block_vnni_linear(x, blocks, bias)` reads the same tiled blocks as block_linear.py but
quantizes x per row and block of 32 to int8_linear's two int8 digits (~16 bits) and
runs the dot products on vpdpbusd: ~2x fewer instructions per weight than expanding
every code to float32. It changes the layer's function exactly as `--quantization
gguf`'s int8 kernel does (same activation digits, same integer dots; only the float
sums differ in order), so it serves that mode only, at up to MAX_ROWS rows: the
default float route stays exact.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.block_linear import BlockWeights
from kvflow.kernels.cpu.native_build import INT64, POINTER, load_bound

MAX_ROWS = 8  # the kernel's limit: one pass over the weights per call
# Where it beats the exact block kernel and the int8 kernel (Zen 4, one thread: 1.4x at
# one row, 1.4x at two, a tie at three and four, slower beyond: each row repeats the
# per-block scaling the float kernels share between rows).
FASTER_ROWS = 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_bound(
        "block_vnni",
        {"kvflow_block_vnni_linear": [ctypes.c_int, *[POINTER] * 4, *[INT64] * 4]},
    )
    if library is None:
        return None
    library.kvflow_block_vnni_isa.restype = ctypes.c_int
    return library if library.kvflow_block_vnni_isa() == 1 else None


def available() -> bool:
    """Whether this CPU and build run the kernel (AVX512-VNNI with BW and VL)."""
    return _library() is not None


def applies(x: torch.Tensor, blocks: BlockWeights, bias: torch.Tensor | None) -> bool:
    return (
        x.dtype == torch.float32
        and x.is_cpu
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == blocks.in_features
        and x.stride(1) == 1
        and (
            bias is None
            or (
                bias.dtype == torch.float32
                and bias.shape == (blocks.out_features,)
                and bias.is_contiguous()
            )
        )
        and _library() is not None
    )


def block_vnni_linear(
    x: torch.Tensor,  # float32 [rows, in_features], rows <= MAX_ROWS
    blocks: BlockWeights,  # W [out_features, in_features]
    bias: torch.Tensor | None = None,  # float32 [out_features]
) -> torch.Tensor:  # float32 [rows, out_features]
    """F.linear(x, dequantize(blocks), bias) on int8 activation digits, for a call
    `applies` accepted."""
    rows = x.shape[0]
    y = torch.empty(rows, blocks.out_features)
    library = _library()
    assert library is not None  # applies() checked it
    status = native_calls.run(
        library.kvflow_block_vnni_linear,
        blocks.code, x.data_ptr(), blocks.address, None if bias is None else bias.data_ptr(),
        y.data_ptr(), rows, blocks.in_features, blocks.out_features, x.stride(0),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native block VNNI linear failed with status {status}")
    return y

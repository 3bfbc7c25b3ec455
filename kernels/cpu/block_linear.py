"""Small-batch linear layers over GGUF block-quantized weights (block_linear.cpp).

A model converted from a Q8_0 / Q4_0 / Q4_1 GGUF runs on the float32 weights those
blocks encode; the blocks themselves are 4-5x smaller. `BlockWeights` keeps them in the
kernel's layout beside the float32 weight, and `block_linear(x, blocks, bias)` computes
F.linear(x, dequantized weight, bias) for at most MAX_ROWS float32 rows (the decode step
of a few requests, bound by reading the weights) while reading only the blocks. The
values are expanded exactly (`dequantize` reproduces the float32 weights bit for bit),
so results differ from F.linear's only in summation order.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu.native_build import INT64, POINTER, load_bound

MAX_ROWS = 48  # measured crossover with oneDNN on float32 weights: between 48 and 64
BLOCK = 32  # weights per block, every format
# GGUF type name -> (kernel format code, bytes per raw GGUF block).
FORMATS = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_bound(
        "block_linear",
        {
            "kvflow_block_linear": [ctypes.c_int, *[POINTER] * 6, *[INT64] * 4],
            "kvflow_block_dequantize": [ctypes.c_int, *[POINTER] * 4, INT64, INT64],
        },
    )


def available() -> bool:
    return _library() is not None


@dataclass(frozen=True)
class BlockWeights:
    """W [out_features, in_features] in a block format, in the kernel's layout."""

    format: str  # a key of FORMATS
    codes: torch.Tensor  # int8 [N, K] (Q8_0) or uint8 [N, K / 2] (Q4_*)
    scales: torch.Tensor  # float32 [N, K / 32]
    mins: torch.Tensor | None  # float32 [N, K / 32], Q4_1 only
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.scales.shape[0])

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @classmethod
    def from_gguf(cls, format: str, raw: torch.Tensor, in_features: int) -> BlockWeights:
        """From GGUF's raw blocks, uint8 [N, K / 32 * block bytes]: per block a float16
        scale, for Q4_1 a float16 offset, then the codes."""
        if format not in FORMATS:
            raise ValueError(f"block format {format!r} is not one of {sorted(FORMATS)}")
        block_bytes = FORMATS[format][1]
        row_bytes = in_features // BLOCK * block_bytes
        if in_features % BLOCK or raw.dim() != 2 or raw.dtype != torch.uint8:
            raise ValueError(f"{format} blocks need uint8 [N, K/32*{block_bytes}], K % 32 == 0")
        if raw.shape[1] != row_bytes:
            raise ValueError(f"{format} blocks of shape {tuple(raw.shape)} for K={in_features}")
        blocks = raw.reshape(raw.shape[0], in_features // BLOCK, block_bytes)

        def half(offset: int) -> torch.Tensor:  # float16 field at `offset` of every block
            return blocks[:, :, offset : offset + 2].contiguous().view(torch.float16)[..., 0]

        header = 4 if format == "Q4_1" else 2
        codes = blocks[:, :, header:].reshape(raw.shape[0], -1).contiguous()
        return cls(
            format=format,
            codes=codes.view(torch.int8) if format == "Q8_0" else codes,
            scales=half(0).float().contiguous(),
            mins=half(2).float().contiguous() if format == "Q4_1" else None,
            in_features=in_features,
        )

    def pointers(self) -> tuple[int, int, int | None]:
        return (
            self.codes.data_ptr(),
            self.scales.data_ptr(),
            None if self.mins is None else self.mins.data_ptr(),
        )


def dequantize(blocks: BlockWeights) -> torch.Tensor:
    """The float32 weights [N, K] the blocks encode, by the kernel's own arithmetic."""
    library = _library()
    if library is None:
        raise RuntimeError("native CPU kernels unavailable")
    out = torch.empty(blocks.out_features, blocks.in_features)
    status = library.kvflow_block_dequantize(
        FORMATS[blocks.format][0], *blocks.pointers(), out.data_ptr(),
        blocks.in_features, blocks.out_features,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native block dequantize failed with status {status}")
    return out


def applies(x: torch.Tensor, blocks: BlockWeights, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel takes this call."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == blocks.in_features
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(1) == 1
        and (
            bias is None
            or (
                bias.shape == (blocks.out_features,)
                and bias.dtype == torch.float32
                and bias.is_contiguous()
            )
        )
        and _library() is not None
    )


def block_linear(
    x: torch.Tensor,  # float32 [rows, in_features], rows <= MAX_ROWS
    blocks: BlockWeights,  # W [out_features, in_features]
    bias: torch.Tensor | None = None,  # float32 [out_features]
) -> torch.Tensor:  # float32 [rows, out_features]
    """F.linear(x, dequantize(blocks), bias), for a call `applies` accepted (the
    dispatcher checked it: only the shape is checked again here)."""
    if x.dim() != 2 or x.shape[1] != blocks.in_features:
        raise ValueError(f"block_linear does not take x {tuple(x.shape)} {x.dtype}")
    rows = x.shape[0]
    y = torch.empty(rows, blocks.out_features)
    library = _library()
    assert library is not None  # applies() checked it
    status = library.kvflow_block_linear(
        FORMATS[blocks.format][0], x.data_ptr(), *blocks.pointers(),
        None if bias is None else bias.data_ptr(), y.data_ptr(),
        rows, blocks.in_features, blocks.out_features, x.stride(0),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native block linear failed with status {status}")
    return y

"""Small-batch linear layers over GGUF block-quantized weights (block_linear.cpp).

A model converted from a Q8_0 / Q4_0 / Q4_1 GGUF runs on the float32 weights those
blocks encode; the blocks themselves are 4-5x smaller. `BlockWeights` keeps them in the
kernel's layout beside the float32 weight, and `block_linear(x, blocks, bias)` computes
F.linear(x, dequantized weight, bias) for at most MAX_ROWS float32 rows (the decode step
of a few requests, bound by reading the weights) while reading only the blocks. The
values are expanded exactly (`dequantize` reproduces the float32 weights bit for bit),
so results differ from F.linear's only in summation order.

A bfloat16 model whose bf16 weights are those float32 values rounded gets the blocks too.
At up to MAX_ROWS_BF16 rows its rows are widened to float32, multiplied with the
unrounded weights and rounded back to bf16 once (one rounding fewer than the bf16
route; what makes the default dtype's single stream read 111 MB instead of 270). From
there up to MAX_ROWS_BF16_DOT rows (a speculative verification step's k + 1) the bf16
rows' kernel (block_linear_bf16.h) computes the bf16 route's own function, weights
rounded to bf16, on vdpbf16ps, still reading each block once for all rows. Where the
CPU lacks AVX512_BF16 that kernel runs on float32 vectors and the dispatch keeps
MAX_ROWS_BF16 (not measured faster than the bf16 routes there).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from dataclasses import dataclass, field

import torch

from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import INT64, POINTER, load_bound

MAX_ROWS = 48  # measured crossover with oneDNN on float32 weights: between 48 and 64
MAX_ROWS_BF16 = 2  # against the native bf16 GEMM: 7.1 vs 12.6 ms at 1 row, 13.8 vs 11.5 at 3
# The bf16 rows' kernel against the native bf16 GEMM, all linear layers of a step of the
# embedded model's shape (docs/benchmarks.md, spec decoding), one thread, process
# CPU time: 13.3 vs 14.9 ms at 4 rows, 14.4 vs 14.4 at 5, 16.4 vs 15.4 at 6, 24.3 vs
# 16.4 at 8; at two threads the GEMM is bound by DRAM (270 MB at ~33 GB/s >= 8.2 ms), the
# kernel by its multiply-adds, which two cores split: the crossover moves to ~6.
MAX_ROWS_BF16_DOT = 6
BLOCK = 32  # weights per block, every format
# GGUF type name -> (kernel format code, bytes per raw GGUF block).
FORMATS = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}
TILE = 4  # weight rows per tile of the packed layout (block_linear.cpp)
# What tests build to check the portable path on any machine of the architecture.
PORTABLE_MARCH = "x86-64" if platform.machine() in ("x86_64", "AMD64") else "armv8-a"


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    """The kernel built for `march`: "native" in production; tests also build older
    ISAs (PORTABLE_MARCH, AVX2 without AVX-512) to check every path on one machine."""
    return load_bound(
        "block_linear",
        {
            "kvflow_block_linear": [ctypes.c_int, *[POINTER] * 4, *[INT64] * 4],
            "kvflow_block_linear_bf16": [ctypes.c_int, *[POINTER] * 4, *[INT64] * 4],
            "kvflow_block_linear_bf16_dot": [ctypes.c_int, *[POINTER] * 4, *[INT64] * 4],
            "kvflow_block_dequantize": [ctypes.c_int, POINTER, POINTER, INT64, INT64],
        },
        march,
    )


def available() -> bool:
    return _library() is not None


def _code_bytes(format: str) -> int:  # codes of one row's block
    return BLOCK if format == "Q8_0" else BLOCK // 2


@dataclass(frozen=True)
class BlockWeights:
    """W [out_features, in_features] in a block format, in the kernel's tiled layout:
    per tile of TILE rows and block of 32 columns one record, [d x 4 | m x 4 (Q4_1) |
    codes of the 4 rows] (float32 d and m, GGUF-ordered codes), tiles back to back. A
    thread then reads its share of W as one sequential stream."""

    format: str  # a key of FORMATS
    packed: torch.Tensor  # uint8 [tiles, K / 32, record bytes]
    in_features: int
    out_features: int
    # What every call passes, looked up once (a decode step makes ~120 calls).
    code: int = field(init=False, repr=False)  # the kernel's format code
    address: int = field(init=False, repr=False)  # packed.data_ptr()

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", FORMATS[self.format][0])
        object.__setattr__(self, "address", self.packed.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

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
        n, blocks = raw.shape[0], in_features // BLOCK
        padded = torch.zeros(-(-n // TILE) * TILE, blocks, block_bytes, dtype=torch.uint8)
        padded[:n] = raw.reshape(n, blocks, block_bytes)

        def tiled(field: torch.Tensor) -> torch.Tensor:  # [rows, blocks, b] -> [tiles, blocks, 4b]
            tiles = field.reshape(-1, TILE, blocks, field.shape[-1]).transpose(1, 2)
            return tiles.reshape(tiles.shape[0], blocks, -1)

        def half(offset: int) -> torch.Tensor:  # float16 field at `offset`, as float32 bytes
            field = padded[:, :, offset : offset + 2].contiguous().view(torch.float16)
            return tiled(field.float().view(torch.uint8))

        header = 4 if format == "Q4_1" else 2
        parts = [half(0), *([half(2)] if format == "Q4_1" else []), tiled(padded[:, :, header:])]
        return cls(format, torch.cat(parts, dim=-1).contiguous(), in_features, n)

    def _field(self, start: int, size: int) -> torch.Tensor:
        """Bytes [start, start + size) of each row's part of every record: [N, K / 32, size]."""
        tiles, blocks = self.packed.shape[:2]
        part = self.packed[:, :, start : start + TILE * size].reshape(tiles, blocks, TILE, size)
        return part.transpose(1, 2).reshape(-1, blocks, size)[: self.out_features]

    @property
    def scales(self) -> torch.Tensor:  # float32 [N, K / 32]
        return self._field(0, 4).contiguous().view(torch.float32)[..., 0]

    @property
    def mins(self) -> torch.Tensor | None:  # float32 [N, K / 32], Q4_1 only
        if self.format != "Q4_1":
            return None
        return self._field(4 * TILE, 4).contiguous().view(torch.float32)[..., 0]

    @property
    def codes(self) -> torch.Tensor:
        """int8 [N, K] (Q8_0) or uint8 [N, K / 2] (Q4_*), GGUF's order within a block."""
        header = 4 * TILE * (2 if self.format == "Q4_1" else 1)
        codes = self._field(header, _code_bytes(self.format)).reshape(self.out_features, -1)
        return codes.contiguous().view(torch.int8) if self.format == "Q8_0" else codes.contiguous()


def dequantize(blocks: BlockWeights, march: str = "native") -> torch.Tensor:
    """The float32 weights [N, K] the blocks encode, by the kernel's own arithmetic."""
    library = _library(march)
    if library is None:
        raise RuntimeError("native CPU kernels unavailable")
    out = torch.empty(blocks.out_features, blocks.in_features)
    status = library.kvflow_block_dequantize(
        blocks.code, blocks.address, out.data_ptr(), blocks.in_features, blocks.out_features
    )
    if status != 0:
        raise RuntimeError(f"native block dequantize failed with status {status}")
    return out


@functools.cache
def bf16_dot_native(march: str = "native") -> bool:
    """Whether the bf16 rows' kernel runs on vdpbf16ps in this build (AVX512_BF16)."""
    library = _library(march)
    return library is not None and library.kvflow_block_linear_bf16_dot_isa() == 1


def row_limit(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return MAX_ROWS
    if dtype == torch.bfloat16:
        return MAX_ROWS_BF16_DOT if bf16_dot_native() else MAX_ROWS_BF16
    return 0


def applies(x: torch.Tensor, blocks: BlockWeights, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel takes this call (cheapest checks first: it runs on
    every linear call of a decode step)."""
    return (
        x.is_cpu
        and x.dim() == 2
        and 0 < x.shape[0] <= row_limit(x.dtype)
        and x.shape[1] == blocks.in_features
        and x.stride(1) == 1
        and (
            bias is None
            or (
                bias.dtype == x.dtype
                and bias.shape == (blocks.out_features,)
                and bias.is_contiguous()
            )
        )
        and _library() is not None
    )


def block_linear(
    x: torch.Tensor,  # float32 or bfloat16 [rows, in_features], rows <= row_limit (any, here)
    blocks: BlockWeights,  # W [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features], x's dtype
    march: str = "native",
) -> torch.Tensor:  # [rows, out_features], x's dtype
    """F.linear(x, dequantize(blocks), bias) in float32, for a call `applies` accepted
    (the dispatcher checked it: only the shape is checked again here)."""
    if x.dim() != 2 or x.shape[1] != blocks.in_features:
        raise ValueError(f"block_linear does not take x {tuple(x.shape)} {x.dtype}")
    rows = x.shape[0]
    y = torch.empty(rows, blocks.out_features, dtype=x.dtype)
    library = _library(march)
    assert library is not None  # applies() checked it
    # bf16 rows: widened in the kernel, the result rounded once; beyond MAX_ROWS_BF16 on
    # bf16 weights, every block expanded once for all rows.
    function = (
        library.kvflow_block_linear
        if x.dtype == torch.float32
        else library.kvflow_block_linear_bf16
        if rows <= MAX_ROWS_BF16
        else library.kvflow_block_linear_bf16_dot
    )
    status = native_calls.run(
        function,
        blocks.code, x.data_ptr(), blocks.address, None if bias is None else bias.data_ptr(),
        y.data_ptr(), rows, blocks.in_features, blocks.out_features, x.stride(0),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native block linear failed with status {status}")
    return y

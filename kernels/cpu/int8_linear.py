"""Quantized linear layers at every batch size: integer dot products (int8_linear.cpp).

`QuantWeights` holds W [N, K] as 32-weight blocks of unsigned 4- or 8-bit codes u with
a float scale d and offset m per block (w = u * d + m). It is made either from a float
weight (`from_float`: Q8_0, symmetric int8 per block, made at load time) or from the
GGUF blocks a checkpoint already has (`from_blocks`: Q4_0, Q4_1, Q8_0, same values).

`int8_linear(x, weights, bias)` quantizes each row of x per block of 32 to two int8
digits (x ~= e (xq + xr / 256), e = max|x| / 127: ~16 bits) and sums integer products,
on AVX512-VNNI where present. Unlike the exact GGUF route of block_linear.py this is
not the float model's function to the last bit, but close: one int8 digit (what
llama.cpp does) lost 1-3% per layer on the embedded model; two lose ~0.01%. `reference` is the
spec in torch; docs/quantization.md holds the accuracy check against the float model.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from dataclasses import dataclass, field

import torch

from kvflow.kernels.cpu import huge_pages, native_calls
from kvflow.kernels.cpu.block_linear import BLOCK, BlockWeights
from kvflow.kernels.cpu.native_build import INT64, POINTER, load_bound

HALF = BLOCK // 2
# What tests build to check the portable path on any machine of the architecture.
PORTABLE_MARCH = "x86-64" if platform.machine() in ("x86_64", "AMD64") else "armv8-a"
_SIGNATURES = {
    "kvflow_int8_linear_isa": [],
    "kvflow_int8_linear": [ctypes.c_int, *[POINTER] * 6, *[INT64] * 4],
    "kvflow_int8_quantize_rows": [*[POINTER] * 5, INT64, INT64],
}


@functools.cache
def library(march: str = "native") -> ctypes.CDLL | None:
    return load_bound("int8_linear", _SIGNATURES, march)


def uses_vnni(march: str = "native") -> bool:
    """Whether the build for `march` runs the dot products on AVX512-VNNI."""
    lib = library(march)
    return lib is not None and lib.kvflow_int8_linear_isa() == 1


def unit_order(blocks: int) -> torch.Tensor:
    """For the kernel's unit layout of `blocks` blocks: position -> natural index of the
    element (units of 4, 2, 1 blocks; first halves of a unit's blocks, then second)."""
    order: list[int] = []
    start = 0
    for size in [4] * (blocks // 4) + [2] * (blocks % 4 // 2) + [1] * (blocks % 2):
        for half in (0, 1):
            for k in range(size):
                first = (start + k) * BLOCK + half * HALF
                order.extend(range(first, first + HALF))
        start += size
    return torch.tensor(order, dtype=torch.long)


@dataclass(frozen=True)
class QuantWeights:
    """W [out_features, in_features] as blocks of unsigned codes, in the kernel's layout."""

    bits: int  # 4 (two codes a byte, GGUF's Q4 order) or 8 (unit layout)
    codes: torch.Tensor  # uint8 [N, K / 2] or [N, K]
    scales: torch.Tensor  # d, float16 [N, K / 32] (GGUF's own precision)
    offsets: torch.Tensor  # m, float16 [N, K / 32]
    in_features: int
    origin: str = "float"  # "float" (made by from_float), else the GGUF block format
    # codes, scales, offsets data_ptr(), looked up once (a decode step makes ~120 calls)
    addresses: tuple[int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = (self.codes, self.scales, self.offsets)
        object.__setattr__(self, "addresses", tuple(t.data_ptr() for t in parts))
        if self.scales.dtype != torch.float16 or self.offsets.dtype != torch.float16:
            raise ValueError("scales and offsets are half floats")
        # The kernel reads no offsets for 8-bit codes: they are -128 d by definition.
        if self.bits == 8 and not torch.equal(self.offsets, -128 * self.scales):
            raise ValueError("8-bit codes need offsets == -128 * scales")
        if self.bits not in (4, 8) or self.in_features % BLOCK:
            raise ValueError(f"{self.bits}-bit codes, in_features {self.in_features}")

    @property
    def out_features(self) -> int:
        return int(self.scales.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per pass."""
        parts = (self.codes, self.scales) + ((self.offsets,) if self.bits == 4 else ())
        return sum(t.numel() * t.element_size() for t in parts)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> QuantWeights:
        """Q8_0 of a float weight [N, K], K % 32 == 0: d = max|w| / 127 per block, stored
        as a half float, q = round(w / d) with that stored d, u = q + 128, m = -128 d."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"Q8_0 needs in_features % {BLOCK} == 0, got {k}")
        w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        d = (w.abs().amax(dim=-1) / 127).clamp(max=torch.finfo(torch.float16).max).half()
        d32 = d.float()[..., None]
        q = torch.where(d32 > 0, w / d32.clamp_min(1e-30), 0).round().clamp(-127, 127)
        codes = (q.reshape(n, k) + 128).to(torch.uint8)[:, unit_order(k // BLOCK)]
        return cls(8, huge_pages.copy(codes), d.contiguous(), (-128 * d).contiguous(), k)

    @classmethod
    def from_blocks(cls, blocks: BlockWeights) -> QuantWeights:
        """The same weights as GGUF blocks (block_linear.py's layout), bit for bit."""
        d, k = blocks.scales.half(), blocks.in_features  # GGUF stores them as halves
        if blocks.format == "Q8_0":
            codes = (blocks.codes.to(torch.int16) + 128).to(torch.uint8)
            ordered = huge_pages.copy(codes[:, unit_order(k // BLOCK)])
            return cls(8, ordered, d, -128 * d, k, "Q8_0")
        if blocks.format == "Q4_0":
            return cls(4, blocks.codes, d, -8 * d, k, "Q4_0")
        assert blocks.mins is not None, "Q4_1 blocks carry their offsets"
        return cls(4, blocks.codes, d, blocks.mins.half(), k, "Q4_1")

    def natural_codes(self) -> torch.Tensor:
        """The codes u as uint8 [N, K / 32, 32], weight order."""
        n, k = self.out_features, self.in_features
        if self.bits == 8:
            natural = torch.empty_like(self.codes)
            natural[:, unit_order(k // BLOCK)] = self.codes
            return natural.reshape(n, k // BLOCK, BLOCK)
        pairs = self.codes.reshape(n, k // BLOCK, HALF)
        return torch.cat([pairs & 15, pairs >> 4], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] the codes encode."""
        u = self.natural_codes().float()
        w = u * self.scales.float()[..., None] + self.offsets.float()[..., None]
        return w.reshape(self.out_features, self.in_features)


Digits = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_rows(x: torch.Tensor) -> Digits:
    """x float32 [M, K] -> (xq, xr int8 [M, K], scale e [M, K/32], float sum s [M, K/32]):
    the spec of the kernel's activation quantization, x ~= e (xq + xr / 256), both
    digits rounded half to even."""
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # A true division (torch's `127.0 / t` multiplies by a reciprocal: 1 ulp off at times).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(1e-30), 0.0)
    first = (blocks * inv[..., None]).round()
    # x * inv - first rounded once to float32, as the kernel's fma: exact in float64.
    residual = (blocks.double() * inv.double()[..., None] - first.double()).float()
    second = (residual * 256).round().clamp(-127, 127)
    digits = [d.to(torch.int8).reshape(m, k) for d in (first, second)]
    return digits[0], digits[1], amax / 127.0, blocks.sum(dim=-1)


def reference(
    x: torch.Tensor, weights: QuantWeights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's function in float64 torch: with x ~= e (xq + xr / 256) per block,
    4-bit codes: sum_b d_b (u . x~)_b + m_b s_b (s: the exact float sum of the block);
    8-bit codes: sum_b d_b ((u - 128) . x~)_b, all in integers before the scale."""
    xq, xr, e, s = quantize_rows(x.float())
    blocks = weights.in_features // BLOCK
    u = weights.natural_codes().double() - (128 if weights.bits == 8 else 0)
    xd = (xq.double() + xr.double() / 256).reshape(-1, blocks, BLOCK)
    dots = torch.einsum("mbj,nbj->mnb", xd, u)
    y = (dots * weights.scales.double()[None] * e.double()[:, None]).sum(-1)
    if weights.bits == 4:
        y = y + s.double() @ weights.offsets.double().T
    return (y if bias is None else y + bias.double()).float()


def applies(x: torch.Tensor, weights: QuantWeights) -> bool:
    return (
        x.dim() == 2
        and x.shape[1] == weights.in_features
        and x.device.type == "cpu"
        and x.is_floating_point()
        and library() is not None
    )


def int8_linear(
    x: torch.Tensor,  # [rows, in_features], any float dtype (computed in float32)
    weights: QuantWeights,
    bias: torch.Tensor | None = None,  # [out_features]
    march: str = "native",
) -> torch.Tensor:  # [rows, out_features], x's dtype
    lib = library(march)
    if lib is None or x.dim() != 2 or x.shape[1] != weights.in_features:
        raise ValueError(f"int8_linear does not take x {tuple(x.shape)} (or no native kernel)")
    x32 = x if x.dtype == torch.float32 and x.stride(1) == 1 else x.float().contiguous()
    b32 = bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        b32 = bias.float().contiguous()
    n = weights.codes.shape[0]
    y = torch.empty(x.shape[0], n)
    status = native_calls.run(
        lib.kvflow_int8_linear,
        weights.bits, x32.data_ptr(), *weights.addresses, None if b32 is None else b32.data_ptr(),
        y.data_ptr(), x.shape[0], weights.in_features, n, x32.stride(0),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native int8 linear failed with status {status}")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def native_quantize_rows(x: torch.Tensor, march: str = "native") -> Digits:
    """The kernel's own activation quantization (tests compare it with `quantize_rows`)."""
    lib = library(march)
    assert lib is not None
    m, k = x.shape
    x = x.float().contiguous()
    xq, xr = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k, dtype=torch.int8)
    e, s = torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK)
    status = lib.kvflow_int8_quantize_rows(
        x.data_ptr(), xq.data_ptr(), xr.data_ptr(), e.data_ptr(), s.data_ptr(), m, k
    )
    if status != 0:
        raise RuntimeError(f"native int8 quantize failed with status {status}")
    return xq, xr, e, s

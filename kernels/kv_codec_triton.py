"""The quantized KV row format (kernels/kv_codec.py) read and written inside Triton kernels.

Kernels see a quantized cache as raw bytes (`kernel_view`, a uint8 view): each row is
head_dim one-byte codes and then the row's float32 scale as 4 little-endian bytes, so the
row stride is head_dim + 4 elements of the view. Codecs are told apart by a constexpr id
(`codec_id`): a float cache (id 0) keeps its own dtype and is read as before.

Decoding is done on the bits, not with triton's fp8 types: `tl.float8e4nv` compiles only
on sm89+ GPUs, while integer ops and an fp16 bitcast compile everywhere and run the same
under the interpreter (which does convert finite fp8 codes right, but not their NaN/inf
codes). An e5m2 code is the high byte of an fp16; an e4m3 code shifted into an fp16's
exponent and mantissa bits is the code's value / 256 (subnormals included), so the 256
goes into the row's scale (`load_scale`), where it costs nothing. (e4m3's NaN code reads
as 480 this way; the quantizer never writes it.)

Encoding rounds like `kv_codec.quantize_rows` (int8: half to even; fp8: to nearest even)
by adding and subtracting a power of two whose ulp is the code grid's step at the value's
binade: fp32 addition rounds to nearest even, on a GPU and in numpy alike. Divisions use
`div_rn` (IEEE), as torch does; a GPU's default `/` may be off by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels import kv_codec

# Codec ids (constexpr globals, so that jitted code may compare CODEC against them).
FLOAT = tl.constexpr(0)
INT8 = tl.constexpr(1)
E4M3 = tl.constexpr(2)
E5M2 = tl.constexpr(3)

_CODEC_IDS: dict[torch.dtype, int] = {
    torch.int8: INT8.value,
    torch.float8_e4m3fn: E4M3.value,
    torch.float8_e5m2: E5M2.value,
}


def codec_id(dtype: torch.dtype) -> int:
    """The kernels' constexpr id for a cache of `dtype` (FLOAT for float caches)."""
    return _CODEC_IDS.get(dtype, FLOAT.value)


def kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel gets for a cache: its bytes if quantized, else the cache itself."""
    return kv_cache.view(torch.uint8) if kv_codec.is_quantized(kv_cache.dtype) else kv_cache


@triton.jit
def decode_codes(b, CODEC: tl.constexpr):
    """uint8 codes -> fp32 code values; a row's value is `code * load_scale(row)`."""
    if CODEC == INT8:
        return b.to(tl.int8, bitcast=True).to(tl.float32)
    elif CODEC == E4M3:
        bits = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x7F).to(tl.uint16) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)  # value / 256
    else:
        return (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_scale(ptr, mask, CODEC: tl.constexpr):
    """fp32 scale of each row whose scale bytes start at `ptr` (no alignment needed),
    times the codec's code unit; masked rows get 0."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    bits |= tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32) << 8
    bits |= tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32) << 16
    bits |= tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32) << 24
    scale = bits.to(tl.float32, bitcast=True)
    if CODEC == E4M3:
        scale = scale * 256.0
    return scale


@triton.jit
def _round_to_grid(a, CODEC: tl.constexpr):
    """|value| `a` (fp32, <= qmax) rounded to the nearest code magnitude, ties to even."""
    if CODEC == INT8:
        return (a + 8388608.0) - 8388608.0  # 2^23: ulp 1
    else:
        # Step of the grid at a's binade: 2^(e - mantissa bits), e clamped at the
        # smallest normal exponent (subnormal codes share its step).
        exp_field = (a.to(tl.uint32, bitcast=True) >> 23) & 0xFF
        if CODEC == E4M3:
            magic_field = tl.maximum(exp_field, 127 - 6) + 20  # 3 mantissa bits
        else:
            magic_field = tl.maximum(exp_field, 127 - 14) + 21  # 2 mantissa bits
        magic = (magic_field << 23).to(tl.float32, bitcast=True)
        return (a + magic) - magic


@triton.jit
def encode_rows(x, mask, CODEC: tl.constexpr):
    """fp32 rows [R, D] (masked elements ignored) -> (uint8 codes [R, D], fp32 scale [R])
    exactly as `kv_codec.quantize_rows` computes them."""
    if CODEC == INT8:
        qmax = 127.0
    elif CODEC == E4M3:
        qmax = 448.0
    else:
        qmax = 57344.0
    x = tl.where(mask, x, 0.0)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), qmax)  # [R]
    divisor = tl.where(scale > 0, scale, 1.0)  # an all-zero row keeps scale 0, codes 0
    scaled = tl.math.div_rn(x, divisor[:, None])
    a = _round_to_grid(tl.minimum(tl.abs(scaled), qmax), CODEC)
    negative = (scaled.to(tl.uint32, bitcast=True) >> 31) != 0  # -0.0 included, like torch
    if CODEC == INT8:
        codes = tl.where(negative, -a, a).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        if CODEC == E4M3:
            magnitude = (a * 0.00390625).to(tl.float16).to(tl.uint16, bitcast=True) >> 7
        else:
            magnitude = a.to(tl.float16).to(tl.uint16, bitcast=True) >> 8
        codes = (magnitude | tl.where(negative, 0x80, 0).to(tl.uint16)).to(tl.uint8)
    return codes, scale


@triton.jit
def scale_bytes(scale):
    """fp32 scales [R] -> their little-endian bytes [R, 4] (uint8)."""
    bits = scale.to(tl.uint32, bitcast=True)
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    return ((bits[:, None] >> shifts[None, :]) & 0xFF).to(tl.uint8)

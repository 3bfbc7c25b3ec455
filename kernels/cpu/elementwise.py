"""Launchers of the fused CPU elementwise kernels (elementwise.cpp): residual add +
RMSNorm, SiLU(gate) * up, rotary embedding of query and key in one call, and the store
of a step's keys/values into the paged cache. The torch references are the layers in
gpu_worker/layers/norm.py, activation.py, rotary.py and the torch attention backend's
`_store_kv`, which call these when `applies` says so.

These run 4-6 times per layer and step, so the launchers stay lean: a ctypes call
costs about 0.25 us per argument, a torch op 1-10 us, and at one decode row that is
the whole cost of the kernel. Where Python's headers are installed the kernels are
called through a small CPython module instead of ctypes (native_build.load_module).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from kvflow.kernels import kv_codec
from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound, load_module

_SIGNATURES = {
    "kvflow_rms_norm": [ctypes.c_int, *[POINTER] * 5, INT64, INT64, ctypes.c_float],
    "kvflow_silu_and_mul": [ctypes.c_int, POINTER, POINTER, INT64, INT64],
    "kvflow_rotary_qk": [ctypes.c_int, *[POINTER] * 4, *[INT64] * 6],
    "kvflow_store_kv": [ctypes.c_int, *[POINTER] * 4, *[INT64] * 6],
    "kvflow_store_kv_quant": [ctypes.c_int, ctypes.c_int, *[POINTER] * 4, *[INT64] * 7],
}

# storage dtype of a quantized cache (kv_codec) -> the store's codec number
_CODEC_CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@functools.cache
def _library() -> Any:
    """The kernels as a CPython module of fast calls, else through ctypes (the same
    names and arguments; null pointers as 0), else None."""
    module = load_module("elementwise")
    if module is not None:
        return module
    return load_bound("elementwise", _SIGNATURES)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these tensors: contiguous, on the CPU, one
    supported dtype (else the caller runs its torch ops)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return False
    # a list, not a generator: this runs several times per layer. The library last: a
    # CUDA run never builds the CPU kernels.
    if not all([t.is_cpu and t.dtype == dtype and t.is_contiguous() for t in tensors]):
        return False
    return _library() is not None


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
        native_calls.run(
            library.kvflow_rms_norm,
            DTYPE_CODES[x.dtype],
            x.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            0 if summed is None else summed.data_ptr(),
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
        native_calls.run(
            library.kvflow_silu_and_mul,
            DTYPE_CODES[x.dtype],
            x.data_ptr(),
            out.data_ptr(),
            x.numel() // (2 * d),
            d,
        ),
        "silu_and_mul",
    )
    return out


def rotary_qk(
    q: torch.Tensor,  # [T, q_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, k_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [T, head_dim // 2] contiguous (any [T, 1, half] view of it)
    sin: torch.Tensor,
) -> None:
    """Neox-layout rotary embedding of q and k in one pass. q and k may be row views of
    one wider tensor (the fused qkv projection): only their heads must be contiguous."""
    library = _library()
    assert library is not None, "call only where rotary_applies() is true"
    rows, q_heads, head_dim = q.shape
    status = native_calls.run(
        library.kvflow_rotary_qk,
        DTYPE_CODES[q.dtype], q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        rows, q_heads, k.shape[1], head_dim, q.stride(0), k.stride(0),
    )  # fmt: skip
    _check(status, "rotary_qk")


def rotary_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotary_qk` takes these: CPU tensors of one supported dtype, contiguous
    heads in q and k, cos/sin rows of exactly half a head."""
    if not applies(cos) or q.dtype != cos.dtype or k.dtype != cos.dtype:
        return False
    head_dim = q.shape[-1]
    return (
        q.dim() == 3
        and k.dim() == 3
        and q.is_cpu
        and k.is_cpu
        and k.shape[2] == head_dim
        and k.shape[0] == q.shape[0]
        and cos.numel() == q.shape[0] * (head_dim // 2)
        and q.stride(2) == 1
        and k.stride(2) == 1
        and q.stride(1) == head_dim
        and k.stride(1) == head_dim
    )


def store_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim], heads contiguous
    value: torch.Tensor,  # [T, kv_heads, head_dim], heads contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, row] contiguous
    slots: torch.Tensor,  # [T] int64, -1 = padding (not stored)
) -> None:
    """kv_cache[0/1] at slot slots[t] <- key/value[t]; bounds-checked (ValueError). A
    quantized cache (kv_codec: row = head_dim + 4) gets the rows quantize_rows makes."""
    library = _library()
    assert library is not None, "call only where store_applies() is true"
    rows, kv_heads, head_dim = key.shape
    _, num_blocks, block_size, cache_heads, cache_row = kv_cache.shape
    codec = _CODEC_CODES.get(kv_cache.dtype)
    # The shapes are checked in the kernel (status 2): callers check the layout once per
    # step with store_applies, and the kernel guards against a layer that differs.
    if codec is None:
        status = native_calls.run(
            library.kvflow_store_kv,
            DTYPE_CODES[key.dtype], key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(),
            slots.data_ptr(), rows, kv_heads * head_dim, key.stride(0), value.stride(0),
            num_blocks * block_size, cache_heads * cache_row,
        )  # fmt: skip
    else:
        status = native_calls.run(
            library.kvflow_store_kv_quant,
            DTYPE_CODES[key.dtype], codec, key.data_ptr(), value.data_ptr(),
            kv_cache.data_ptr(), slots.data_ptr(), rows, kv_heads, head_dim, key.stride(0),
            value.stride(0), num_blocks * block_size, cache_heads * cache_row,
        )  # fmt: skip
    if status == 3:
        raise ValueError(f"a KV slot is out of range for a cache of {kv_cache.shape[1]} blocks")
    _check(status, "store_kv")


def store_applies(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
) -> bool:
    """Whether `store_kv` takes these (else the torch path): CPU, a float32/bfloat16
    key and value of the cache's dtype or a quantized cache, contiguous cache and heads,
    int64 slots, shapes that match."""
    dtype = key.dtype
    if kv_cache.dtype in _CODEC_CODES:
        # the library last: a CUDA run never builds the CPU kernels
        quantized_ok = kv_cache.is_cpu and kv_cache.is_contiguous() and dtype in DTYPE_CODES
        if not (quantized_ok and _library() is not None):
            return False
    elif not applies(kv_cache) or dtype != kv_cache.dtype:
        return False
    _, _, _, kv_heads, _ = kv_cache.shape
    head_dim = kv_codec.head_dim_of(kv_cache)
    return (
        value.dtype == dtype
        and key.is_cpu
        and value.is_cpu
        and slots.is_cpu
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and key.shape == value.shape == (slots.shape[0], kv_heads, head_dim)
        and key.stride(2) == value.stride(2) == 1
        and key.stride(1) == value.stride(1) == head_dim
    )

"""Launcher of the native LoRA kernel (lora.cpp): y += the LoRA terms of each row's
adapter slot, on the CPU in float32 or bfloat16. The reference is kernels/lora.py's
`lora_add_reference`; `kernels.lora.lora_add` calls this where `native_applies`."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    """`march`: tests also build the AVX2 (x86-64-v3) fallback of an AVX-512 machine."""
    args = [ctypes.c_int, *[POINTER] * 6, *[INT64] * 7]
    return load_bound("lora", {"kvflow_lora_add": args}, march)


@functools.cache
def _offsets(offsets: tuple[int, ...]) -> torch.Tensor:
    """The slices' offsets as the kernel reads them: made once per layout and kept (a
    recorded decode graph replays the call with this address; no per-call tensor)."""
    return torch.tensor(offsets, dtype=torch.int64)


def native_applies(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPE_CODES
        and y.dtype == a.dtype == b.dtype == x.dtype
        and x.dim() == 2
        and x.stride(1) == 1
        and y.stride(1) == 1
        and a.is_contiguous()
        and b.is_contiguous()
        and _library() is not None
    )


def lora_add_native(
    x: torch.Tensor,  # [T, K]
    y: torch.Tensor,  # [T, N], updated in place
    a: torch.Tensor,  # [L, S*R, K]
    b: torch.Tensor,  # [L, R, N]
    slices: Sequence[tuple[int, int]],  # (offset, size) per slice, in order, covering N
    row_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    march: str = "native",
) -> None:
    rows, k = x.shape
    rank, n = b.shape[1], b.shape[2]
    if a.shape[2] != k or a.shape[1] != len(slices) * rank or y.shape != (rows, n):
        raise ValueError(f"x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} do not match")
    if row_slots.dtype != torch.int32 or row_slots.shape != (rows,):
        raise ValueError("row_slots must be int32 [T]")
    offsets = _offsets(tuple(off for off, _ in slices))
    library = _library(march)
    assert library is not None  # native_applies checked it
    status = native_calls.run(
        library.kvflow_lora_add,
        DTYPE_CODES[x.dtype],
        x.data_ptr(), a.data_ptr(), b.data_ptr(), y.data_ptr(),
        row_slots.data_ptr(), offsets.data_ptr(),
        rows, k, n, len(slices), rank, x.stride(0), y.stride(0),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native LoRA kernel failed with status {status}")

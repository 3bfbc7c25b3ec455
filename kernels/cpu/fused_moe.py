"""Launcher of the native fused experts (fused_moe.cpp): every expert's MLP in one call.

`fused_experts(x, rows, offsets, w13, w2)` is `fused_experts_reference` (the spec, in
kernels/fused_moe_reference.py) on float32 or bfloat16 CPU tensors: the tokens' rows
grouped by expert, gate|up, silu(gate) * up, down, with float32 sums and the
reference's roundings. `fused_moe` also sums each token's rows with its routing weights
(the reference's `combine`) in the same call: no zero-filled [T*k, H] buffer, no
scatter back to token order and no batched matmul around it. Both take the reference's
options (`ExpertOptions`: biases, the clamped SwiGLU). It runs wherever a C++ compiler is
(vector code for the CPU's own ISA, see the source); elsewhere `available()` is False and
the caller keeps the reference.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound
from kvflow.kernels.fused_moe_reference import ClampedSwiGLU, Grouping, Routing


class ExpertOptions(NamedTuple):
    """The reference's options of `fused_experts_reference` (None: not used)."""

    b13: torch.Tensor | None = None  # [E, 2I], x's dtype
    b2: torch.Tensor | None = None  # [E, H]
    clamped: ClampedSwiGLU | None = None


NO_OPTIONS = ExpertOptions()  # silu(gate) * up, no biases


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    arguments = [*[POINTER] * 10, *[INT64] * 7, POINTER, POINTER, INT64, *[ctypes.c_float] * 2]
    signatures = {"kvflow_fused_moe": arguments, "kvflow_fused_moe_isa": []}
    return load_bound("fused_moe", signatures, march)


def available(march: str = "native") -> bool:
    return _library(march) is not None


def vector_bits(march: str = "native") -> int:
    """The vector width the build runs at (512 with AVX-512, 256 with AVX, else 128),
    513 where bf16 dot products use AVX512_BF16."""
    library = _library(march)
    assert library is not None
    return int(library.kvflow_fused_moe_isa())


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (else the reference serves)."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPE_CODES
        and w13.dtype == w2.dtype == x.dtype
        and x.dim() == 2
        and x.stride(1) == 1
        and w13.is_contiguous()
        and w2.is_contiguous()
    )


def fused_experts(
    x: torch.Tensor,  # [T, H], unit column stride
    rows: torch.Tensor,  # [N] int64: the token of each sorted row
    offsets: torch.Tensor,  # [E+1] int64: expert e's sorted rows, absolute
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    march: str = "native",
    options: ExpertOptions = NO_OPTIONS,
) -> torch.Tensor:  # [N, H]: rows outside [offsets[0], offsets[E]) are zero
    """`fused_experts_reference`: each sorted row's expert output."""
    y = torch.zeros(rows.shape[0], x.shape[1], dtype=x.dtype)
    _run(x, rows, offsets, (w13, w2), y, None, march, options)
    return y


def fused_moe(
    x: torch.Tensor,  # [T, H], unit column stride
    grouping: Grouping,  # group_by_expert(routing.ids, all experts)
    routing: Routing,
    offsets: torch.Tensor,  # [E+1] int64: this call's experts' slice of grouping.offsets
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    march: str = "native",
    options: ExpertOptions = NO_OPTIONS,
) -> torch.Tensor:  # [T, H]
    """`combine(fused_experts_reference(...), grouping, routing)`: the tokens' weighted
    sums of their experts' outputs (those among `offsets`' experts), in one call."""
    y = torch.empty(grouping.rows.shape[0], x.shape[1], dtype=x.dtype)  # read where written
    out = torch.empty_like(y[: x.shape[0]])
    _run(x, grouping.rows, offsets, (w13, w2), y, (grouping, routing, out), march, options)
    return out


def _run(
    x: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    weights13_2: tuple[torch.Tensor, torch.Tensor],
    y: torch.Tensor,
    combined: tuple[Grouping, Routing, torch.Tensor] | None,
    march: str,
    options: ExpertOptions,
) -> None:
    w13, w2 = weights13_2
    experts, hidden = w13.shape[0], x.shape[1]
    inter = w13.shape[1] // 2
    if not applies(x, w13, w2) or w13.shape != (experts, 2 * inter, hidden):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} does not fit experts w13 {w13.shape}")
    if w2.shape != (experts, hidden, inter) or offsets.shape != (experts + 1,):
        raise ValueError(f"w2 {tuple(w2.shape)} / offsets {tuple(offsets.shape)} do not fit")
    if rows.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("rows and offsets are int64")
    rows, offsets = rows.contiguous(), offsets.contiguous()
    b13, b2 = _checked_biases(options, x.dtype, experts, hidden, inter)
    clamped = options.clamped or ClampedSwiGLU()  # its numbers unused unless given
    act = torch.empty(rows.shape[0], inter, dtype=x.dtype)  # silu(gate) * up, per row
    inverse = weights = out = None
    top_k = 0
    if combined is not None:
        grouping, routing, out = combined
        inverse, top_k = grouping.inverse, routing.ids.shape[1]
        weights = routing.weights.to(torch.float32).contiguous()
    library = _library(march)
    assert library is not None, "check available() first"
    status = native_calls.run(
        library.kvflow_fused_moe,
        x.data_ptr(),
        rows.data_ptr(),
        offsets.data_ptr(),
        w13.data_ptr(),
        w2.data_ptr(),
        act.data_ptr(),
        y.data_ptr(),
        None if inverse is None else inverse.data_ptr(),
        None if weights is None else weights.data_ptr(),
        None if out is None else out.data_ptr(),
        experts,
        hidden,
        inter,
        x.stride(0),
        x.shape[0],
        top_k,
        DTYPE_CODES[x.dtype],
        None if b13 is None else b13.data_ptr(),
        None if b2 is None else b2.data_ptr(),
        int(options.clamped is not None),
        clamped.alpha,
        clamped.limit,
    )
    if status != 0:
        raise RuntimeError(f"native fused experts failed with status {status}")


def _checked_biases(
    options: ExpertOptions, dtype: torch.dtype, experts: int, hidden: int, inter: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The options' biases, or a ValueError naming the one that does not fit (contiguous:
    a recorded call keeps their addresses, so no temporary copy may stand in)."""
    shapes = {"b13": (experts, 2 * inter), "b2": (experts, hidden)}
    for name, bias in (("b13", options.b13), ("b2", options.b2)):
        if bias is not None and (
            bias.shape != shapes[name] or bias.dtype != dtype or not bias.is_contiguous()
        ):
            raise ValueError(f"{name} {bias.dtype} {tuple(bias.shape)}, expected {shapes[name]}")
    return options.b13, options.b2

"""Launcher of the native fused experts (fused_moe.cpp): every expert's MLP in one call.

`pack(w13, w2)` lays the experts' weights out once (at load) as the kernel reads them:
per expert, panels of PANEL output columns over all of K, k in pairs for bfloat16 (one
AVX512_BF16 vdpbf16ps multiplies a broadcast pair of x with 16 columns), w13's gate
and up columns side by side (fused_moe.cpp's header draws it).
`fused_experts(x, rows, offsets, packed)` is then `fused_experts_reference` (the spec,
in kernels/fused_moe_reference.py) on float32 or bfloat16 CPU tensors: the tokens' rows
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
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvflow.kernels.cpu import huge_pages, native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound
from kvflow.kernels.fused_moe_reference import ClampedSwiGLU, Grouping, Routing


class ExpertOptions(NamedTuple):
    """The reference's options of `fused_experts_reference` (None: not used)."""

    b13: torch.Tensor | None = None  # [E, 2I], x's dtype
    b2: torch.Tensor | None = None  # [E, H]
    clamped: ClampedSwiGLU | None = None


NO_OPTIONS = ExpertOptions()  # silu(gate) * up, no biases
PANEL = 64  # packed output columns per panel (fused_moe.cpp's PANEL); w13: 32 gate + 32 up


@dataclass(frozen=True)
class PackedExperts:
    """w13 [E, 2I, H] and w2 [E, H, I] in the kernel's layout (module docstring): per
    expert, data[panel][k / P][column in panel][k % P], P = 2 for bfloat16, 1 for float32,
    K and the columns zero-padded."""

    w13: torch.Tensor  # [E, ceil(I / 32), ceil(H / P), PANEL, P]
    w2: torch.Tensor  # [E, ceil(H / 64), ceil(I / P), PANEL, P]
    experts: int
    hidden: int
    inter: int
    march: str = "native"  # the build that runs it (tests pin an older ISA)

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype


def _panels(weight: torch.Tensor, pair: int) -> torch.Tensor:
    """One expert's [columns, K] (columns a multiple of PANEL) -> [panels, K / P, PANEL, P]."""
    columns, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -k % pair))
    return padded.reshape(columns // PANEL, PANEL, -1, pair).permute(0, 2, 1, 3)


def _gate_up_columns(w13: torch.Tensor, inter: int) -> torch.Tensor:
    """One expert's [2I, H] -> [I' * 2, H] (I' = I padded to 32): per 32 intermediate
    columns, gate 0-15, up 0-15, gate 16-31, up 16-31 (the kernel's four vectors)."""
    half = PANEL // 2
    gate, up = (torch.nn.functional.pad(w, (0, 0, 0, -inter % half)) for w in w13.split(inter))
    both = torch.stack(
        [gate.reshape(-1, 2, 16, w13.shape[1]), up.reshape(-1, 2, 16, w13.shape[1])], 2
    )
    return both.reshape(-1, w13.shape[1])


def pack(w13: torch.Tensor, w2: torch.Tensor, march: str = "native") -> PackedExperts:
    """The experts' weights (float32 or bfloat16, CPU) in the kernel's layout, expert by
    expert (the peak is one packed copy plus one expert)."""
    experts, hidden, inter = w2.shape
    if w13.shape != (experts, 2 * inter, hidden) or w13.dtype != w2.dtype:
        raise ValueError(f"w13 {w13.dtype} {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit")
    if w13.dtype not in DTYPE_CODES or w13.device.type != "cpu":
        raise ValueError(f"experts in {w13.dtype} on {w13.device} are not packed")
    pair = 2 if w13.dtype == torch.bfloat16 else 1
    first = _panels(_gate_up_columns(w13[0], inter), pair)
    second = _panels(torch.nn.functional.pad(w2[0], (0, 0, 0, -hidden % PANEL)), pair)
    packed13 = huge_pages.empty((experts, *first.shape), w13.dtype)
    packed2 = huge_pages.empty((experts, *second.shape), w2.dtype)
    for e in range(experts):
        packed13[e] = _panels(_gate_up_columns(w13[e], inter), pair)
        packed2[e] = _panels(torch.nn.functional.pad(w2[e], (0, 0, 0, -hidden % PANEL)), pair)
    return PackedExperts(packed13, packed2, experts, hidden, inter, march)


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    arguments = [*[POINTER] * 10, *[INT64] * 7, POINTER, POINTER, INT64, *[ctypes.c_float] * 2]
    signatures = {
        "kvflow_fused_moe": arguments,
        "kvflow_fused_moe_isa": [],
        "kvflow_fused_moe_panel": [],
    }
    library = load_bound("fused_moe", signatures, march)
    if library is not None and library.kvflow_fused_moe_panel() != PANEL:
        raise RuntimeError("fused_moe.cpp's PANEL differs from fused_moe.py's")
    return library


def available(march: str = "native") -> bool:
    return _library(march) is not None


def vector_bits(march: str = "native") -> int:
    """The vector width the build runs at (512 with AVX-512, 256 with AVX, else 128),
    513 where bf16 dot products use AVX512_BF16."""
    library = _library(march)
    assert library is not None
    return int(library.kvflow_fused_moe_isa())


def applies(x: torch.Tensor, packed: PackedExperts) -> bool:
    """Whether the kernel takes these operands (else the reference serves)."""
    return (
        x.device.type == "cpu"
        and x.dtype == packed.dtype
        and x.dim() == 2
        and x.shape[1] == packed.hidden
        and x.stride(1) == 1
    )


def fused_experts(
    x: torch.Tensor,  # [T, H], unit column stride
    rows: torch.Tensor,  # [N] int64: the token of each sorted row
    offsets: torch.Tensor,  # [E+1] int64: expert e's sorted rows, absolute
    packed: PackedExperts,  # pack(w13 [E, 2I, H], w2 [E, H, I])
    options: ExpertOptions = NO_OPTIONS,
) -> torch.Tensor:  # [N, H]: rows outside [offsets[0], offsets[E]) are zero
    """`fused_experts_reference`: each sorted row's expert output."""
    y = torch.zeros(rows.shape[0], x.shape[1], dtype=x.dtype)
    _run(x, rows, offsets, packed, y, None, options)
    return y


def fused_moe(
    x: torch.Tensor,  # [T, H], unit column stride
    grouping: Grouping,  # group_by_expert(routing.ids, all experts)
    routing: Routing,
    offsets: torch.Tensor,  # [E+1] int64: this call's experts' slice of grouping.offsets
    packed: PackedExperts,  # pack(w13 [E, 2I, H], w2 [E, H, I])
    options: ExpertOptions = NO_OPTIONS,
) -> torch.Tensor:  # [T, H]
    """`combine(fused_experts_reference(...), grouping, routing)`: the tokens' weighted
    sums of their experts' outputs (those among `offsets`' experts), in one call."""
    y = torch.empty(grouping.rows.shape[0], x.shape[1], dtype=x.dtype)  # read where written
    out = torch.empty_like(y[: x.shape[0]])
    _run(x, grouping.rows, offsets, packed, y, (grouping, routing, out), options)
    return out


def _run(
    x: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    packed: PackedExperts,
    y: torch.Tensor,
    combined: tuple[Grouping, Routing, torch.Tensor] | None,
    options: ExpertOptions,
) -> None:
    experts, hidden, inter = packed.experts, packed.hidden, packed.inter
    if not applies(x, packed):
        raise ValueError(
            f"x {x.dtype} {tuple(x.shape)} does not fit experts {packed.dtype} H={hidden}"
        )
    if offsets.shape != (experts + 1,):
        raise ValueError(f"offsets {tuple(offsets.shape)} do not fit {experts} experts")
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
    library = _library(packed.march)
    assert library is not None, "check available() first"
    status = native_calls.run(
        library.kvflow_fused_moe,
        x.data_ptr(),
        rows.data_ptr(),
        offsets.data_ptr(),
        packed.w13.data_ptr(),
        packed.w2.data_ptr(),
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

"""Launcher of the native bfloat16 GEMM (bf16_gemm.cpp) on weights packed for it at load.

`pack(weight)` lays a bf16 [out, in] weight out as the kernel reads it (panels of
PANEL output columns x all of `in` as interleaved k-pairs, for AVX512_BF16's
vdpbf16ps); `bf16_gemm(x, packed, bias)` is then F.linear with float32 accumulation
and one bf16 rounding of the output, at any number of rows.

A gate|up layer (the MLP's `gate_up_proj`) is packed by `pack(weight, glu=True)`: its
two halves each padded to whole panels, so that one task holds the gate's and the up's
panel of the same columns and `bf16_gemm_silu_and_mul` applies silu(gate) * up as
the products come out. That is the unfused GEMM + SiLU*up bit for bit, without the
[rows, 2 * inter] intermediate: at a 2,048-token prefill of SmolLM2 the separate
SiLU*up pass reread 12.6 MB a layer (docs/benchmarks.md, "SiLU*up in the GEMM").

Where it applies it replaces oneDNN's packed inner product (packed_linear.py) for the
layer: measured on a Zen 4 EPYC (AVX512_BF16, no AMX) it is faster at every shape of
SmolLM2 and every row count tried, 1 to 1024 (docs/benchmarks.md, "Native bf16 GEMM").
It applies only where this CPU has AVX512_BF16 (the kernel reports it: a build without
the instructions refuses every call) and `in` is even; elsewhere pack() returns None
and the layer keeps oneDNN's layout.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu import huge_pages, native_calls
from kvflow.kernels.cpu.native_build import INT64, POINTER, load_bound


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    signatures = {
        "kvflow_bf16_gemm": [*[POINTER] * 4, *[INT64] * 4],
        "kvflow_bf16_gemm_silu_mul": [*[POINTER] * 4, *[INT64] * 4],
        "kvflow_bf16_gemm_isa": [],
        "kvflow_bf16_gemm_panel": [],
    }
    return load_bound("bf16_gemm", signatures, march)


def available(march: str = "native") -> bool:
    """Whether the kernel runs here: built, and built with AVX512_BF16."""
    library = _library(march)
    return library is not None and library.kvflow_bf16_gemm_isa() == 1


@dataclass(frozen=True)
class PanelWeight:
    """A bf16 weight [out_features, in_features] in the kernel's layout:
    data[panel][k / 2][column in panel][k % 2], out_features zero-padded to whole panels."""

    data: torch.Tensor  # [panels, in_features / 2, panel, 2] bf16
    out_features: int
    in_features: int
    march: str = "native"  # the build that packed it (tests pack for an older ISA)
    glu: bool = False  # gate|up: each half padded to whole panels (its panels, then up's)

    def halves(self) -> tuple[PanelWeight, PanelWeight]:
        """A glu weight's gate and up, each a PanelWeight of out_features / 2 (views)."""
        assert self.glu
        panels = self.data.shape[0] // 2
        half = self.out_features // 2
        return (
            PanelWeight(self.data[:panels], half, self.in_features, self.march),
            PanelWeight(self.data[panels:], half, self.in_features, self.march),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def panel_width(march: str = "native") -> int:
    library = _library(march)
    assert library is not None
    return int(library.kvflow_bf16_gemm_panel())


def pack(weight: torch.Tensor, march: str = "native", glu: bool = False) -> PanelWeight | None:
    """`weight` [out, in] in the kernel's layout, or None where the kernel does not apply
    (not bf16 on the CPU, odd `in`, no AVX512_BF16 build). `glu`: a gate|up weight, its
    halves packed apart (see the module docstring)."""
    if (
        weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.dtype != torch.bfloat16
        or weight.shape[1] % 2
        or (glu and weight.shape[0] % 2)
        or not available(march)
    ):
        return None
    if glu:
        gate, up = (_pack_panels(half, march) for half in weight.chunk(2))
        data = torch.cat([gate.data, up.data])
        return PanelWeight(data, weight.shape[0], weight.shape[1], march, glu=True)
    return _pack_panels(weight, march)


def _pack_panels(weight: torch.Tensor, march: str) -> PanelWeight:
    out_features, in_features = weight.shape
    panel = panel_width(march)
    padded = -(-out_features // panel) * panel
    plain = torch.zeros(padded, in_features, dtype=weight.dtype)
    plain[:out_features] = weight
    panels = plain.view(padded // panel, panel, in_features // 2, 2).permute(0, 2, 1, 3)
    data = huge_pages.copy(panels)  # streamed from DRAM at every decode step
    return PanelWeight(data, out_features, in_features, march)


def applies(x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.shape[1] == packed.in_features
        and x.stride(1) == 1
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    )


def bf16_gemm(
    x: torch.Tensor,  # [rows, in_features] bf16, unit column stride
    packed: PanelWeight,  # `pack(weight)`
    bias: torch.Tensor | None = None,  # [out_features] bf16
) -> torch.Tensor:  # [rows, out_features] bf16
    if not applies(x, packed, bias) or (bias is not None and bias.shape != (packed.out_features,)):
        raise ValueError(
            f"x {x.dtype} {tuple(x.shape)} (strides {x.stride()}) does not fit a packed bf16 "
            f"weight [{packed.out_features}, {packed.in_features}]"
        )
    if packed.glu:  # rarely (the MLP fuses): each half on its own, side by side
        gate, up = packed.halves()
        gate_bias, up_bias = (None, None) if bias is None else bias.chunk(2)
        return torch.cat([bf16_gemm(x, gate, gate_bias), bf16_gemm(x, up, up_bias)], dim=1)
    return _run("kvflow_bf16_gemm", x, packed, bias, packed.out_features)


def bf16_gemm_silu_and_mul(
    x: torch.Tensor,  # [rows, in_features] bf16, unit column stride
    packed: PanelWeight,  # `pack(weight, glu=True)` of a gate|up weight [2 * inter, in]
    bias: torch.Tensor | None = None,  # [2 * inter] bf16
) -> torch.Tensor:  # [rows, inter] bf16: silu(gate) * up
    """`bf16_gemm` then elementwise.silu_and_mul, bit for bit, in one pass."""
    if not packed.glu:
        raise ValueError("silu(gate) * up needs a weight packed with glu=True")
    if not applies(x, packed, bias) or (bias is not None and bias.shape != (packed.out_features,)):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} does not fit a packed gate|up weight")
    return _run("kvflow_bf16_gemm_silu_mul", x, packed, bias, packed.out_features // 2)


def _run(
    kernel: str, x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None, width: int
) -> torch.Tensor:
    rows = x.shape[0]
    y = torch.empty(rows, width, dtype=torch.bfloat16)
    if rows == 0:
        return y
    library = _library(packed.march)
    assert library is not None  # pack() checked it
    status = native_calls.run(
        getattr(library, kernel),
        x.data_ptr(),
        packed.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        packed.in_features,
        width,
        x.stride(0),
    )
    if status != 0:
        raise RuntimeError(f"native bf16 GEMM ({kernel}) failed with status {status}")
    return y

"""Linear layers on weights packed once into oneDNN's blocked layout.

A matmul with a plain [out, in] weight makes oneDNN reorder that weight into its
blocked form on every call (or run a slower path that reads it as is). Packing it once
at load time (`pack`) removes that from every step; the results are bit-identical to
F.linear on the plain weight (same kernel, same summation order; a unit test checks).

Measured on a Zen 4 EPYC (2 threads, AVX512-BF16, no AMX), the model's layer shapes,
30 layers' weights streamed from DRAM per pass (docs/benchmarks.md, "Packed weights"):

    rows   bfloat16: F.linear -> packed      float32: oneDNN plain -> packed
    1      14.9 -> 11.0 ms                    20.5 -> 19.7 ms
    8      18.5 -> 11.0 ms                    29.7 -> 20.3 ms
    64     47.3 -> 37.7 ms                    87.8 -> 72.9 ms

The packed tensor is opaque (an mkldnn tensor): only `packed_linear` reads it, so the
layer's plain weight can be freed once packed (gpu_worker/weight_packing.py).
"""

from __future__ import annotations

import functools
import os

import torch

from kvflow.kernels.cpu.native_build import cpu_flags

PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack and multiply `dtype` weights with oneDNN. bf16
    needs oneDNN's bf16 support on this CPU (AVX512-BF16/AMX natively, else emulated)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())


@functools.cache
def amx_bf16() -> bool:
    """Whether oneDNN multiplies bf16 on AMX here: the CPU has AMX-BF16 and
    ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA), where set, admits an AMX ISA."""
    if not available(torch.bfloat16) or "amx_bf16" not in cpu_flags():
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    return cap.upper() == "ALL" or "AMX" in cap.upper()


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's blocked layout, or None where that does not apply
    (not on the CPU, another dtype, no oneDNN)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not available(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def applies(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == packed.dtype
        and (bias is None or bias.dtype == x.dtype)
    )


def packed_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # `pack(weight)`
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [rows, out_features]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

"""`linear(x, weight, bias, blocks, quant, packed_weight)`: F.linear routed to the fastest CPU implementation.
(`linear_silu_and_mul`: the same for a gate|up layer, with SiLU*up fused where the
route is the native bf16 GEMM.)

    `--quantization gguf`, GGUF blocks, rows    the VNNI block kernel (block_vnni.py: the
    <= block_vnni.FASTER_ROWS, AVX512-VNNI      int8 kernel's arithmetic on the blocks'
                                                tiled layout: ~1.4x faster at one row)
    the layer has `--quantization` weights      the int8 kernel (int8_linear.py: not
                                                the float function): q8_0 at every batch
                                                size, a GGUF's Q4 blocks at <= 48 rows
                                                (elsewhere its exact routes are faster)
    rows <= block_linear.MAX_ROWS, float32,     the native block kernel: reads the GGUF
    the layer has GGUF blocks                   blocks `weight` was dequantized from
                                                (4-5x fewer bytes, same values)
    the layer's weight is packed (every CPU     its plain weight is freed, so this is the
    layer in fp32/bf16: weight_packing.py)      route: bf16 with AVX512_BF16 packed for the
                                                native bf16 GEMM (bf16_gemm.py: ahead of
                                                oneDNN at every shape and batch size
                                                measured), else oneDNN on its blocked
                                                layout (packed_linear.py: faster than the
                                                routes below at every batch size but
                                                float32 single rows, where the skinny
                                                kernel is ~15% ahead)
    rows <= skinny_linear.MAX_ROWS (fp32/bf16)  the native skinny kernel: one pass over
                                                the weights, the decode step of a few
                                                requests
    more rows, float32                          oneDNN's inner product
    anything else (CUDA, fp16, no oneDNN)       F.linear

Why oneDNN for float32: torch's F.linear sends float32 to MKL's sgemm, which at the
9-128 rows of a batched decode step runs at about half the rate oneDNN reaches (on an
AVX2 EPYC: 64 x 576 -> 49152, the LM head, 74 vs 125 GFLOP/s); at prefill sizes the
two are equal. bfloat16 and float16 already go to oneDNN inside F.linear. Results equal
F.linear's up to float32 summation order.
"""

from __future__ import annotations

import functools
from typing import TypeAlias

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import bf16_gemm, block_linear, block_vnni, int8_linear, packed_linear
from kvflow.kernels.cpu.bf16_gemm import PanelWeight
from kvflow.kernels.cpu.block_linear import BlockWeights
from kvflow.kernels.cpu.int8_linear import QuantWeights
from kvflow.kernels.cpu.skinny_linear import native_applies, run_native

# Module switches: benchmarks and tests compare each route with the next one down.
ONEDNN_FLOAT32 = True
GGUF_BLOCKS = True
GGUF_VNNI = True

# A layer's weight packed at load (gpu_worker/weight_packing.py): for the native bf16
# GEMM, or an opaque mkldnn tensor in oneDNN's blocked layout.
PackedWeight: TypeAlias = PanelWeight | torch.Tensor


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        ONEDNN_FLOAT32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and _onednn_available()
    )


def _int8_route(x: torch.Tensor, quant: QuantWeights, blocks_apply: bool) -> bool:
    """Whether a quantized layer's call goes to the int8 kernel. Q8_0 made from float
    weights (`--quantization q8_0`) always does. A GGUF's blocks (`gguf`) encode the
    layer's float32 weights exactly, so the faster exact route takes over where the
    int8 kernel is not ahead (docs/benchmarks.md): Q8_0 blocks at <= 48 rows (the
    float block kernel) and any layer above 48 rows (compute-bound: oneDNN float32)."""
    exact_is_faster = x.shape[0] > block_linear.MAX_ROWS or (
        blocks_apply and quant.origin == "Q8_0"
    )
    return not (quant.origin != "float" and exact_is_faster) and int8_linear.applies(x, quant)


def _vnni_route(
    x: torch.Tensor, blocks: BlockWeights | None, bias: torch.Tensor | None, quant: QuantWeights
) -> bool:
    """Whether a `gguf` layer's call goes to the VNNI block kernel: the same int8
    digits and integer dots as the int8 kernel, read from the blocks' tiled layout
    (one sequential stream per thread), faster at one or two rows (docs/benchmarks.md)."""
    return (
        GGUF_VNNI
        and blocks is not None
        and quant.origin != "float"  # q8_0's weights are not the blocks' values
        and x.shape[0] <= block_vnni.FASTER_ROWS
        and block_vnni.applies(x, blocks, bias)
    )


def _exact_or_quantized_route(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: BlockWeights | None,
    quant: QuantWeights | None,
) -> str | None:
    """The route that comes before the packed weight's, if one applies: "vnni",
    "int8" or "blocks" (the table in the module docstring, top three rows)."""
    if quant is not None and _vnni_route(x, blocks, bias, quant):
        return "vnni"
    blocks_apply = blocks is not None and GGUF_BLOCKS and block_linear.applies(x, blocks, bias)
    if quant is not None and _int8_route(x, quant, blocks_apply):
        return "int8"
    return "blocks" if blocks_apply else None


def linear(
    x: torch.Tensor,  # [rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
    blocks: BlockWeights | None = None,  # `weight` as GGUF blocks, when the layer has them
    quant: QuantWeights | None = None,  # the layer's quantized weights (`--quantization`)
    packed_weight: PackedWeight | None = None,  # `weight` packed at load (weight_packing.py)
) -> torch.Tensor:  # [rows, out_features]
    route = _exact_or_quantized_route(x, bias, blocks, quant)
    if route == "vnni":
        assert blocks is not None and quant is not None  # _vnni_route checked them
        return block_vnni.block_vnni_linear(x, blocks, bias)
    if route == "int8":
        assert quant is not None
        return int8_linear.int8_linear(x, quant, bias)
    if route == "blocks":
        assert blocks is not None
        return block_linear.block_linear(x, blocks, bias)
    if isinstance(packed_weight, PanelWeight):  # the plain weight may be freed: the route
        return bf16_gemm.bf16_gemm(x, packed_weight, bias)
    if packed_weight is not None:
        if not packed_linear.applies(x, packed_weight, bias):
            raise ValueError(f"a packed {packed_weight.dtype} layer got {x.dtype} {x.device} input")
        return packed_linear.packed_linear(x, packed_weight, bias)
    if native_applies(x, weight, bias):
        return run_native(x, weight, bias)
    if onednn_applies(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor,  # [rows, in_features]
    bias: torch.Tensor | None = None,  # [2 * inter]
    blocks: BlockWeights | None = None,
    quant: QuantWeights | None = None,
    packed_weight: PackedWeight | None = None,
) -> torch.Tensor | None:  # [rows, inter]
    """silu(gate) * up of a gate|up layer in one pass, where `linear` would take the
    native bf16 GEMM and the weight was packed for it with glu=True; else None (the
    caller runs `linear` and then its activation)."""
    if not isinstance(packed_weight, PanelWeight) or not packed_weight.glu:
        return None
    if _exact_or_quantized_route(x, bias, blocks, quant) is not None:
        return None
    return bf16_gemm.bf16_gemm_silu_and_mul(x, packed_weight, bias)

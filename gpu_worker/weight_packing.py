"""Pack the linear layers' weights once, after loading (CPU, float32/bfloat16).

Each linear layer and the LM head gets `packed_weight`, its weight laid out for the
kernel that will serve it:

* bfloat16 on a CPU with AVX512_BF16 and no AMX (and an even input width): the native
  bf16 GEMM's panels (kernels/cpu/bf16_gemm.py: ahead of oneDNN at every shape and batch
  size measured there, 1.1-1.25x per decode step at batch 64 on one thread, 2x at batch
  8); an MLP's gate|up layer in halves, so that the GEMM applies SiLU*up as it goes;
* otherwise oneDNN's blocked layout (kernels/cpu/packed_linear.py: the same results as
  F.linear, 1.25-1.7x faster per decode step in bfloat16 than F.linear). On a CPU with
  AMX this includes bfloat16: oneDNN's AMX kernels lead the native GEMM 1.6x at 8 rows
  and 4.7x at 64 over the 1B shape's layers (12x at 256), and trail it 1.25x at one row
  (docs/benchmarks.md, "bf16 on an AMX Xeon").

The layer's plain weight is then freed, so the model's memory does not double; kept is
only an LM head's weight tied to the embedding (the embedding's lookup reads it). The
freed memory goes back to the OS as packing goes (every `_TRIM_BYTES`), or the process
would hold both copies at the end (gpu_worker/host_memory.py).

A layer whose `--quantization` weights always take the int8 kernel (q8_0) gets nothing
packed, and its float weight is freed too: no route reads it (kernels/cpu/linear.py),
and keeping it held 1.95 GB of bf16 beside 1.3 GB of codes at the 1B shape.

A mixture-of-experts layer's experts (layers/moe.py `FusedExperts`) are packed for the
native fused-expert kernel (kernels/cpu/fused_moe.py), whatever PACK_WEIGHTS says: that
kernel is their only fast CPU route.

A GGUF's exact blocks (block_weights.py) still serve their layers at small batch; the
packed weight serves them above that, where oneDNN's float32 route was.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvflow.gpu_worker.host_memory import return_freed_heap
from kvflow.gpu_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvflow.gpu_worker.layers.moe import FusedExperts
from kvflow.kernels.cpu import bf16_gemm, packed_linear
from kvflow.kernels.cpu.linear import PackedWeight

logger = logging.getLogger(__name__)

# Module switches: benchmarks compare the packed route with the plain one in one
# process, and the native bf16 GEMM with oneDNN (None: by the CPU, `_native_bf16`).
PACK_WEIGHTS = True
NATIVE_BF16: bool | None = None
FUSED_SILU = True
_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
_TRIM_BYTES = 512 << 20


def _free_unless_embedded(weight: torch.Tensor, embedded: set[int]) -> int:
    """Free a plain weight nothing reads any more; returns the bytes freed."""
    if id(weight) in embedded:
        return 0
    nbytes = weight.numel() * weight.element_size()
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return nbytes


def _always_int8(layer: nn.Module) -> bool:
    quant = getattr(layer, "quant", None)
    return quant is not None and quant.origin == "float"  # q8_0: int8 at every size


def pack(weight: torch.Tensor, glu: bool = False) -> PackedWeight | None:
    """`weight` in the layout of the kernel that serves it best, or None (not packable).
    `glu`: a gate|up weight, packed (for the native bf16 GEMM) so that the GEMM can apply
    SiLU*up itself."""
    panels = bf16_gemm.pack(weight, glu=glu and FUSED_SILU) if _native_bf16() else None
    return panels if panels is not None else packed_linear.pack(weight)


def _native_bf16() -> bool:
    """Whether bf16 layers go to the native GEMM (where it runs): not where oneDNN has
    AMX, whose tiles outrun AVX512_BF16 from a few rows up."""
    return NATIVE_BF16 if NATIVE_BF16 is not None else not packed_linear.amx_bf16()


def pack_weights(model: nn.Module) -> int:
    """Set `packed_weight` on every CPU linear layer and LM head it applies to and free
    the plain weights nothing else reads; returns how many layers were packed (the
    experts of mixture-of-experts layers included)."""
    experts = sum(m.pack_for_cpu() for m in model.modules() if isinstance(m, FusedExperts))
    if not PACK_WEIGHTS:
        return experts
    embedded = {
        id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding
    }  # tied LM heads share these
    packed, native, nbytes, untrimmed = 0, 0, 0, 0
    for layer in model.modules():
        if not isinstance(layer, _LAYERS):
            continue
        weight = layer.weight
        if _always_int8(layer):
            untrimmed += _free_unless_embedded(weight, embedded)
            continue
        packed_weight = pack(weight.data, glu=getattr(layer, "glu", False))
        if packed_weight is None:
            continue
        layer.packed_weight = packed_weight
        packed += 1
        native += isinstance(packed_weight, bf16_gemm.PanelWeight)
        nbytes += weight.numel() * weight.element_size()
        untrimmed += _free_unless_embedded(weight, embedded)
        if untrimmed >= _TRIM_BYTES:
            return_freed_heap()
            untrimmed = 0
    return_freed_heap()
    if packed:
        logger.info(
            "packed %d linear layers' weights (%.0f MB): %d for the native bf16 GEMM, the rest "
            "for oneDNN",
            packed,
            nbytes / 1e6,
            native,
        )
    return packed + experts

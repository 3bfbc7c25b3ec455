"""Pack the linear layers' weights for oneDNN once, after loading (CPU, float32/bfloat16).

Each linear layer and the LM head gets `onednn_weight`, its weight in oneDNN's blocked
layout (kernels/cpu/packed_linear.py: the same results as F.linear, 1.25-1.7x faster
per decode step in bfloat16). The layer's plain weight is then freed, so the model's
memory does not double; kept are the weights something else still reads:

* an LM head tied to the embedding (the embedding's lookup reads the shared weight);
* a layer whose `--quantization` weights always take the int8 kernel (q8_0): nothing
  is packed for it, its float weight stays as gpu_worker/quantization.py left it.

A GGUF's exact blocks (block_weights.py) still serve their layers at small batch; the
packed weight serves them above that, where oneDNN's float32 route was.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvflow.gpu_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvflow.kernels.cpu import packed_linear

logger = logging.getLogger(__name__)

# Module switch: benchmarks compare the packed route with the plain one in one process.
PACK_WEIGHTS = True
_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _always_int8(layer: nn.Module) -> bool:
    quant = getattr(layer, "quant", None)
    return quant is not None and quant.origin == "float"  # q8_0: int8 at every size


def pack_weights(model: nn.Module) -> int:
    """Set `onednn_weight` on every CPU linear layer and LM head it applies to and free
    the plain weights nothing else reads; returns how many layers were packed."""
    if not PACK_WEIGHTS:
        return 0
    embedded = {
        id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding
    }  # tied LM heads share these
    packed, nbytes = 0, 0
    for layer in model.modules():
        if not isinstance(layer, _LAYERS) or _always_int8(layer):
            continue
        weight = layer.weight
        onednn_weight = packed_linear.pack(weight.data)
        if onednn_weight is None:
            continue
        layer.onednn_weight = onednn_weight
        packed += 1
        nbytes += weight.numel() * weight.element_size()
        if id(weight) not in embedded:
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    if packed:
        logger.info("packed %d linear layers' weights for oneDNN (%.0f MB)", packed, nbytes / 1e6)
    return packed

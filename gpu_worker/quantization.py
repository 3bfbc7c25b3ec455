"""`--quantization`: give every linear layer (and the LM head) quantized weights that
kernels/cpu/int8_linear.py multiplies with int8 activations, at every batch size.

    none   float weights (the default); a converted GGUF's blocks are still read
           exactly at small batch (block_weights.py)
    q8_0   Q8_0 blocks made at load time from the float weights of any checkpoint
    gguf   the checkpoint's own GGUF blocks (Q4_0/Q4_1/Q8_0), as llama.cpp computes
           with them; layers without blocks get Q8_0

Both change the model's function (int8 activations, and for q8_0 the weights): the
accuracy check against the float model is in docs/quantization.md. CPU only; the float
weights stay in place only for the embedding lookup (tied to the LM head): q8_0 layers'
own are freed after loading (weight_packing.py).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from kvflow.errors import ConfigError
from kvflow.gpu_worker.layers.embedding import ParallelLMHead
from kvflow.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvflow.kernels.cpu import int8_linear
from kvflow.kernels.cpu.block_linear import BLOCK
from kvflow.kernels.cpu.int8_linear import QuantWeights

logger = logging.getLogger(__name__)

Quantization = Literal["none", "q8_0", "gguf"]
METHODS: tuple[str, ...] = ("none", "q8_0", "gguf")
_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _weights_of(layer: nn.Module, method: str) -> QuantWeights:
    blocks = getattr(layer, "blocks", None)
    if method == "gguf" and blocks is not None:
        return QuantWeights.from_blocks(blocks)
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return QuantWeights.from_float(weight)


def quantize_model(model: nn.Module, method: str) -> int:
    """Set `layer.quant` on every linear layer and the LM head; returns how many."""
    if method == "none":
        return 0
    if method not in METHODS:
        raise ConfigError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if int8_linear.library() is None:
        raise ConfigError(f"quantization {method} needs the native CPU kernels (a C++ compiler)")
    from kvflow.gpu_worker.layers.moe import FusedExperts

    if any(isinstance(m, FusedExperts) for m in model.modules()):
        # The 8-bit routes cover linear layers; experts would stay float, silently.
        raise ConfigError(
            f"quantization {method} covers dense linear layers only; "
            "this model's experts (MoE) are not quantized: use quantization none"
        )
    layers = [m for m in model.modules() if isinstance(m, _LAYERS)]
    if method == "gguf" and not any(getattr(m, "blocks", None) is not None for m in layers):
        raise ConfigError(
            "quantization gguf needs a GGUF checkpoint's blocks (a .gguf model in float32); "
            "use q8_0 for other checkpoints"
        )
    nbytes, from_blocks, skipped = 0, 0, 0
    for layer in layers:
        if layer.weight.device.type != "cpu":
            raise ConfigError("quantization runs on the CPU only")
        if layer.weight.shape[1] % BLOCK:
            skipped += 1  # no whole blocks: the layer keeps its float weights
            continue
        weights = _weights_of(layer, method)
        layer.quant = weights
        nbytes += weights.nbytes
        from_blocks += weights.bits == 4 or getattr(layer, "blocks", None) is not None
    logger.info(
        "quantization %s: %d layers (%d left in float: in_features %% 32), %.0f MB read per "
        "pass (%d from GGUF blocks), dot products on %s", method, len(layers) - skipped,
        skipped, nbytes / 2**20, from_blocks if method == "gguf" else 0,
        "AVX512-VNNI" if int8_linear.uses_vnni() else "portable code",
    )  # fmt: skip
    return len(layers) - skipped

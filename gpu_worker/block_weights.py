"""Give linear layers the GGUF blocks their float32 weights were dequantized from.

A model converted from a GGUF (gguf_convert.py) keeps the Q8_0/Q4_0/Q4_1 blocks of its
matrices in BLOCKS_FILE beside the float32 checkpoint. When the model runs in float32 on
the CPU, each linear layer (and the LM head) gets a `blocks` copy in the kernel layout
(kernels/cpu/block_linear.py), sliced for the layer's tensor-parallel rank and packed
the way the layer packs its weight (q|k|v, gate|up). `kernels/cpu/linear.py` then reads
the blocks for decode steps of a few rows: 4-5x fewer bytes than the float32 weights.

A copy is attached only where dequantizing it reproduces the layer's float32 weight bit
for bit, so a layer computes the same function whichever form it reads. A bfloat16 model
gets them where its bf16 weight is that float32 weight rounded: at its few rows the
kernel then multiplies with the unrounded values in float32 (block_linear.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvflow.gpu_worker.layers.embedding import ParallelLMHead
from kvflow.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvflow.gpu_worker.weights import packed_target
from kvflow.kernels.cpu import block_linear
from kvflow.kernels.cpu.block_linear import BLOCK, FORMATS, BlockWeights

logger = logging.getLogger(__name__)

BLOCKS_FILE = "gguf_blocks/blocks.safetensors"  # its metadata maps tensor name -> format
BLOCK_FORMATS = tuple(FORMATS)
READ_DTYPES = (torch.float32, torch.bfloat16)  # model dtypes the block kernel serves

# shard_id -> (format, raw GGUF blocks uint8 [rows, bytes per row])
Shards = dict[Any, tuple[str, torch.Tensor]]


def _column_parallel(layer: ColumnParallelLinear, shards: Shards) -> torch.Tensor | None:
    shard_ids = layer.weight.shard_ids  # type: ignore[attr-defined]
    if set(shards) != set(shard_ids):
        return None
    raw = [shards[shard_id][1] for shard_id in shard_ids]
    out = torch.empty(layer.weight.shape[0], raw[0].shape[1], dtype=torch.uint8)
    for shard_id, tensor in zip(shard_ids, raw, strict=True):
        offset, size, start = layer.shard_range(shard_id)
        out[offset : offset + size] = tensor.narrow(0, start, size)
    return out


def _row_parallel(layer: RowParallelLinear, shards: Shards) -> torch.Tensor | None:
    block_format, raw = shards[None]
    start, size = layer.tp.rank * layer.local_input, layer.local_input
    if start % BLOCK or size % BLOCK:
        return None  # this rank's columns cut through blocks
    block_bytes = FORMATS[block_format][1]
    return raw.narrow(1, start // BLOCK * block_bytes, size // BLOCK * block_bytes)


def _lm_head(layer: ParallelLMHead, shards: Shards) -> torch.Tensor | None:
    raw = shards[None][1]
    rows = min(layer.per_rank, layer.num_embeddings - layer.vocab_start)
    out = torch.zeros(layer.per_rank, raw.shape[1], dtype=torch.uint8)  # zero rows decode to 0
    out[:rows] = raw.narrow(0, layer.vocab_start, rows)
    return out


def _layer_blocks(layer: nn.Module, shards: Shards) -> torch.Tensor | None:
    """This rank's blocks of `layer`, packed like its weight, or None if they can't be."""
    if len({block_format for block_format, _ in shards.values()}) != 1:
        return None  # e.g. gate in Q4_1 and up in Q8_0: one layer, one format
    if isinstance(layer, ColumnParallelLinear):
        return _column_parallel(layer, shards)
    if isinstance(layer, RowParallelLinear):
        return _row_parallel(layer, shards)
    if isinstance(layer, ParallelLMHead):
        return _lm_head(layer, shards)
    return None


def _read_shards(model: nn.Module, path: Path) -> dict[str, Shards]:
    """The blocks file's tensors grouped by the layer they belong to."""
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    by_layer: dict[str, Shards] = defaultdict(dict)
    # A fused checkpoint matrix (Phi-3's qkv_proj) splits by rows, as its weight does.
    split = getattr(model, "split_checkpoint_tensor", lambda name, tensor: [(name, tensor)])
    with safe_open(str(path), framework="pt", device="cpu") as f:
        formats = f.metadata() or {}
        for fused_name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            for name, tensor in split(fused_name, f.get_tensor(fused_name)):
                target, shard_id = packed_target(name, mapping)
                layer_name = target.rpartition(".")[0]
                if layer_name == "model.embed_tokens":
                    if not tied:
                        continue  # the lookup reads float32 rows; only an LM head multiplies
                    layer_name = "lm_head"
                by_layer[layer_name][shard_id] = (formats[fused_name], tensor)
    return by_layer


def attach_block_weights(model: nn.Module, model_dir: Path) -> int:
    """Set `layer.blocks` wherever the GGUF blocks encode the layer's weight exactly;
    returns how many layers got them (0 without a blocks file, native kernels, or a
    float32 / bfloat16 CPU model)."""
    path = model_dir / BLOCKS_FILE
    weight = next(model.parameters())
    dtype = weight.dtype
    if not path.is_file() or dtype not in READ_DTYPES or weight.device.type != "cpu":
        return 0
    if not block_linear.available():
        return 0
    layers = dict(model.named_modules())
    attached, block_bytes, skipped = 0, 0, []
    for layer_name, shards in _read_shards(model, path).items():
        layer = layers.get(layer_name)
        raw = None if layer is None else _layer_blocks(layer, shards)
        if layer is None or raw is None:
            skipped.append(layer_name)
            continue
        block_format = next(iter(shards.values()))[0]
        blocks = BlockWeights.from_gguf(block_format, raw, layer.weight.shape[1])
        if not torch.equal(block_linear.dequantize(blocks).to(dtype), layer.weight):
            logger.warning("GGUF blocks of %s do not reproduce its weights: not used", layer_name)
            continue
        layer.blocks = blocks
        attached += 1
        block_bytes += blocks.nbytes
    if skipped:
        logger.info("GGUF blocks not used for %s (layout or format)", ", ".join(skipped))
    logger.info(
        "GGUF blocks: %d layers read them at <= %d rows (%.0f MB beside the %s weights)",
        attached, block_linear.row_limit(dtype), block_bytes / 2**20, dtype,
    )  # fmt: skip
    return attached

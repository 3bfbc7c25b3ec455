"""Where each PEFT target module lives in kvflow's model, and how its weights shard.

    q_proj, k_proj, v_proj  -> self_attn.qkv_proj, slices 0, 1, 2   (column-parallel)
    o_proj                  -> self_attn.o_proj                      (row-parallel)
    gate_proj, up_proj      -> mlp.gate_up_proj, slices 0, 1         (column-parallel)
    down_proj               -> mlp.down_proj                         (row-parallel)

`attach_slots` gives every such projection of the model its `LoraSlots` (a mixture-of-
experts MLP has none: its experts take no LoRA). `shard_pair` cuts one target's A and
B the way the base weight is cut on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvflow.gpu_worker.lora.batch import LoraBatch
from kvflow.gpu_worker.lora.slots import LoraSlots

# PEFT module name -> (kvflow module under the decoder layer, packed shard id)
TARGETS: dict[str, tuple[str, Any]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}
_SLICE_OF_SHARD = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}


@dataclass(frozen=True)
class Target:
    layer: ColumnParallelLinear | RowParallelLinear
    slice_index: int
    shard_id: Any


def attach_slots(
    model: nn.Module, batch: LoraBatch, max_loras: int, max_rank: int,
    dtype: torch.dtype, device: torch.device,
) -> dict[tuple[int, str], Target]:  # fmt: skip
    """Slots on every adaptable projection of this rank's layers; (layer, PEFT name) ->
    where that target's weights go."""
    targets: dict[tuple[int, str], Target] = {}
    decoder: Any = model.model  # LlamaModel: this rank's layers start..end
    for index in range(decoder.start, decoder.end):
        layer: nn.Module = decoder.layers[index]
        for name, (path, shard_id) in TARGETS.items():
            module = layer.get_submodule(path) if _has(layer, path) else None
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue  # an MoE block: its experts take no LoRA
            if module.lora is None:
                module.lora = _slots(module, batch, max_loras, max_rank, dtype, device)
            targets[(index, name)] = Target(module, _SLICE_OF_SHARD[shard_id], shard_id)
    return targets


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def _slots(
    module: ColumnParallelLinear | RowParallelLinear, batch: LoraBatch, max_loras: int,
    max_rank: int, dtype: torch.dtype, device: torch.device,
) -> LoraSlots:  # fmt: skip
    if isinstance(module, RowParallelLinear):
        slices, in_local = [(0, module.output_size)], module.local_input
    else:
        if isinstance(module, QKVParallelLinear):
            slices = [module.shard_range(s)[:2] for s in ("q", "k", "v")]
        elif isinstance(module, MergedColumnParallelLinear):
            slices = [module.shard_range(s)[:2] for s in range(len(module.local_sizes))]
        else:
            slices = [(0, sum(module.local_sizes))]
        in_local = module.input_size
    return LoraSlots(batch, in_local, slices, max_loras, max_rank, dtype, device)


def shard_pair(
    target: Target, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in], B [out, r] of the whole target -> this rank's pieces."""
    layer = target.layer
    if isinstance(layer, RowParallelLinear):
        start = layer.tp.rank * layer.local_input
        return a.narrow(1, start, layer.local_input), b
    _, size, start = layer.shard_range(target.shard_id)
    return a, b.narrow(0, start, size)

"""An adapter's tensors, read from its safetensors file and cut for this rank.

`load_adapter` returns, per adapted projection, one (A, B) pair per packed slice (None
where the adapter leaves a slice alone), already sharded, scaled (B * scaling) and in
the model's dtype, ready to be copied into a slot. Fused targets (Phi-3's qkv_proj,
gate_up_proj) share their A across the parts and split B by the parts' sizes.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from kvflow.gpu_worker.lora.slots import LoraSlots, SlicePair
from kvflow.gpu_worker.lora.targets import Target, shard_pair
from kvflow.lora_files import FUSED_TARGETS, AdapterInfo, BaseShapes

LoadedAdapter = dict[int, tuple[LoraSlots, list[SlicePair]]]  # id(slots) -> its slices


def load_adapter(
    info: AdapterInfo, targets: dict[tuple[int, str], Target], base: BaseShapes,
    dtype: torch.dtype,
) -> LoadedAdapter:  # fmt: skip
    loaded: LoadedAdapter = {}
    with safe_open(str(info.weights_file), framework="pt") as f:
        for (layer, module), (key_a, key_b) in info.modules.items():
            a = f.get_tensor(key_a).to(torch.float32)
            b = f.get_tensor(key_b).to(torch.float32) * info.scaling
            for name, part_b in _parts(module, b, base):
                target = targets.get((layer, name))
                if target is None:  # another pipeline stage's layer
                    continue
                assert target.layer.lora is not None
                slots = target.layer.lora
                pairs = loaded.setdefault(id(slots), (slots, [None] * len(slots.slices)))[1]
                a_local, b_local = shard_pair(target, a, part_b)
                pairs[target.slice_index] = (a_local.to(dtype), b_local.to(dtype))
    return loaded


def _parts(module: str, b: torch.Tensor, base: BaseShapes) -> list[tuple[str, torch.Tensor]]:
    """(PEFT target name, its rows of B): one part, or a fused target's parts."""
    if module not in FUSED_TARGETS:
        return [(module, b)]
    names = FUSED_TARGETS[module]
    sizes = [base.dims(name)[1] for name in names]
    return list(zip(names, b.split(sizes)))

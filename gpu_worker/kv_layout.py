"""The worker's side of the KV cache groups (kvflow/kv_groups.py): which cache tensor
and which block table each attention layer of this pipeline stage uses.

    layout.layer_slots   global layer -> tensor slot 0..num_slots-1 (shared by groups)
    stage_slots          the slots this stage's layers use -> its local tensor index

One group (every model with a single kind of layers, or `--no-hybrid-kv-cache`) gives
slot = layer, so a stage allocates one tensor per layer of its own, as it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.kv_groups import KVGroupLayout, plan_kv_groups


def kv_layout_of(model: Any, hybrid: bool) -> tuple[KVGroupLayout, list[int]]:
    """(the model's KV group layout, the global layer index of each of its attention
    layers in order). A model without `kv_layer_windows` (its stage's first layer and
    every layer's window) is planned from its own attention layers."""
    layers = model.attention_layers()
    if hasattr(model, "kv_layer_windows"):
        first, windows = model.kv_layer_windows()
    else:
        first, windows = 0, tuple(layer.sliding_window for layer in layers)
    layer_ids = list(range(first, first + len(layers)))
    return plan_kv_groups(windows, hybrid), layer_ids


def stage_slots(layout: KVGroupLayout, layer_ids: Sequence[int]) -> dict[int, int]:
    """{slot: index of its tensor among this stage's} for the slots its layers use."""
    used = sorted({layout.layer_slots[i] for i in layer_ids})
    return {slot: index for index, slot in enumerate(used)}

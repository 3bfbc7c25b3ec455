"""KV cache groups: layers of one attention kind share a block table (the hybrid cache).

A model whose layers differ in attention kind (Gemma 2/3: sliding-window "local" layers
and full "global" ones) keeps one block table per *group* of layers of the same kind.
A sliding-window group holds only the blocks some future query can still read, so a
long request costs its global layers every block but its local layers ~W tokens each.

Every group takes its block ids from one shared pool, and a block id means the same
bytes in every group: the cache is `num_slots` tensors `[2, num_blocks, block, heads,
dim]`, and the i-th layer of each group uses tensor i. So groups have (at most)
`num_slots` layers each: a kind with more layers is cut into several groups::

    Gemma-3-1B: 26 layers, every 6th global (5, 11, 17, 23), the others window 1024
    kinds       full: 4 layers        sliding 1024: 22 layers
    groups      g0 full  [5 11 17 23]   g1..g5 sliding [4 layers each]   g6 sliding [2]
    tensors     4 (num_slots); one block id = the K/V of 4 layers for 16 tokens

A block held by g6 leaves its tensors 2 and 3 unused: the price of a shared pool with
fixed-size blocks, small when the smallest kind divides the others (Gemma 2: 1:1).

Group 0 is the full-attention group when there is one. A model with one kind has one
group of all its layers (`num_slots` = layers): exactly the plain paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    windows: tuple[int | None, ...]  # per group: None = full attention, W = sliding window
    layer_groups: tuple[int, ...]  # per layer (global index): its group
    layer_slots: tuple[int, ...]  # per layer: the cache tensor it uses, 0..num_slots-1

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """Cache tensors (layers' worth of K/V per block id)."""
        return max(self.layer_slots, default=-1) + 1

    @property
    def is_hybrid(self) -> bool:
        """More than one block table per request, or one that drops blocks."""
        return self.num_groups > 1 or self.windows[0] is not None

    @property
    def wire_windows(self) -> list[int]:
        """The group windows as sent to the scheduler (0 = full attention)."""
        return [w or 0 for w in self.windows]


def single_group(num_layers: int) -> KVGroupLayout:
    """Every layer in one full-attention group: the plain paged cache."""
    return KVGroupLayout((None,), (0,) * num_layers, tuple(range(num_layers)))


def plan_kv_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVGroupLayout:
    """Groups for layers with these sliding windows (None = full attention).

    `hybrid=False` (or a single kind of layers with no window) gives one group that keeps
    every block; a window shared by every layer gives one group that drops blocks.
    """
    num_layers = len(layer_windows)
    kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    if not hybrid or kinds == [None]:
        return single_group(num_layers)
    layers_of = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in layers_of.values())
    windows: list[int | None] = []
    groups = [0] * num_layers
    slots = [0] * num_layers
    for kind in kinds:
        layers = layers_of[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                groups[layer], slots[layer] = len(windows), slot
            windows.append(kind)
    return KVGroupLayout(tuple(windows), tuple(groups), tuple(slots))


def group_windows_from_wire(windows: Sequence[int]) -> tuple[int | None, ...]:
    """The inverse of `KVGroupLayout.wire_windows`; [] = one full-attention group."""
    return tuple(w or None for w in windows) or (None,)


def max_blocks_held(
    windows: Sequence[int | None], num_tokens: int, block_size: int, max_chunk: int = 0
) -> int:
    """The most blocks a request of `num_tokens` tokens holds at once over all groups,
    computing at most `max_chunk` tokens a step (0: all at once). A sliding group holds
    the blocks from its window's first key to the chunk's last token:
    (c + k - 1) // B - (c - W + 1) // B + 1 <= (W + k - 2) // B + 2."""
    total = -(-num_tokens // block_size)
    chunk = min(num_tokens, max_chunk) if max_chunk > 0 else num_tokens
    return sum(
        total if w is None else min(total, (w + chunk - 2) // block_size + 2) for w in windows
    )

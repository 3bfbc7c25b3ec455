"""The preallocated adapter weights of one projection: `max_loras` slots, max rank.

    a [max_loras, S * max_rank, in_local]    shrink, the S packed slices' A stacked
    b [max_loras, max_rank, out_local]       expand, transposed (scaling folded in)

Allocated once when the model is built; loading an adapter copies into a slot (an
adapter of lower rank is zero-padded), so the memory never changes while serving. With
tensor parallelism the slots are sharded as the base weight is: a column-parallel
projection (qkv, gate_up) keeps B's rows of this rank's output; a row-parallel one
(o, down) keeps A's columns of this rank's input, and its LoRA term joins the partial
sum before the all-reduce (x_r A_r^T B^T summed over ranks is x A^T B^T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.gpu_worker.lora.batch import LoraBatch
from kvflow.kernels.lora import lora_add

# One slice's weights as loaded: A [r, in_local], B [n_local, r] (scaled); None: the
# adapter does not target that slice.
SlicePair = tuple[torch.Tensor, torch.Tensor] | None


class LoraSlots:
    def __init__(
        self,
        batch: LoraBatch,
        in_local: int,
        slices: Sequence[tuple[int, int]],  # (offset, size) in this rank's output
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.slices = list(slices)
        self.max_rank = max_rank
        out_local = sum(size for _, size in self.slices)
        shape_a = (max_loras, len(self.slices) * max_rank, in_local)
        self.a = torch.zeros(shape_a, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, max_rank, out_local, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def load(self, slot: int, pairs: Sequence[SlicePair]) -> None:
        """Copy an adapter's slices into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank = self.max_rank
        for i, pair in enumerate(pairs):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            offset, size = self.slices[i]
            self.a[slot, i * rank : i * rank + r].copy_(a)
            self.b[slot, :r, offset : offset + size].copy_(b.T)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the LoRA terms of this step's adapted rows of x (y is updated in place)."""
        lora_add(x, y, self.a, self.b, self.slices, self.batch.groups_for(x.shape[0]))
        return y

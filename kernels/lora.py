"""The LoRA terms of a mixed batch: a gathered low-rank product per adapter group.

Rows (tokens) of one step belong to different adapters, or to none. Rather than swap
weights per request, every adapted projection adds, for each adapter group g with
rows R_g and slot s::

    y[R_g, off_i : off_i + n_i] += (x[R_g] @ A[s]^T)[:, i*r : (i+1)*r] @ B[s, :, off_i : off_i + n_i]

    x [T, in]             the projection's input rows
    A [L, S*r, in]        slot s's shrink matrices of the S packed slices (q|k|v, gate|up)
    B [L, r, out]         slot s's expand matrices (transposed: a rank's row is contiguous
                          over the outputs, which the kernels vectorize), slices side by side
    slices [(off_i, n_i)] where slice i sits in the packed output

(Punica's SGMV: shrink then expand per segment of rows sorted by slot.) The scaling is
folded into B when an adapter is loaded; a rank below r is zero-padded. `LoraGroups`
is built once per step from each row's slot and serves every layer.

`lora_add` picks the route: the native CPU kernel (kernels/cpu/lora.py) where it is
built, else this torch reference (the spec); on CUDA the Triton kernel
(kernels/lora_triton.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.kernels.cpu import lora as lora_native
from kvflow.kernels.cpu import native_calls

Slices = Sequence[tuple[int, int]]  # (offset, size) of each packed slice in y


@dataclass(frozen=True)
class LoraGroups:
    """Rows grouped by slot: rows[starts[g]:starts[g+1]] use slot slots[g]."""

    rows: torch.Tensor  # [N] int64, the adapted rows sorted by slot (base rows left out)
    starts: list[int]  # [G + 1]
    slots: list[int]  # [G]
    row_slots: torch.Tensor  # [T] int32, each row's slot, -1 = base (the kernels' input)
    # Per group, (first, end) when its rows are consecutive (a decode batch of one
    # adapter, a prompt): a view then, no gather or scatter. None: gathered by `rows`.
    spans: list[tuple[int, int] | None]

    @property
    def num_groups(self) -> int:
        return len(self.slots)


def group_rows(
    row_slots: np.ndarray, device: torch.device, out: torch.Tensor | None = None
) -> LoraGroups:
    """Group rows by slot (-1: the base model, no LoRA term). `out`: an int32 buffer of
    at least T rows to hold `row_slots` (the kernels' input), at a fixed address."""
    order = np.argsort(row_slots, kind="stable")
    order = order[row_slots[order] >= 0]
    sorted_slots = row_slots[order]
    cuts = np.flatnonzero(np.diff(sorted_slots)) + 1
    starts = [0, *cuts.tolist(), len(order)] if len(order) else [0]
    slots = [int(sorted_slots[s]) for s in starts[:-1]]
    spans: list[tuple[int, int] | None] = []
    for start, end in itertools.pairwise(starts):
        first, last = int(order[start]), int(order[end - 1])
        spans.append((first, last + 1) if last - first == end - start - 1 else None)
    slots_now = torch.from_numpy(row_slots.astype(np.int32))
    if out is not None:
        out[: len(row_slots)].copy_(slots_now)
    return LoraGroups(
        rows=torch.from_numpy(order.astype(np.int64)).to(device),
        starts=starts,
        slots=slots,
        row_slots=slots_now.to(device) if out is None else out[: len(row_slots)],
        spans=spans,
    )


def lora_add_reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    slices: Slices, groups: LoraGroups,
) -> None:  # fmt: skip
    """y += the LoRA terms of x's rows, in place (see the module docstring)."""
    rank = b.shape[1]
    for g, slot in enumerate(groups.slots):
        span = groups.spans[g]
        rows = groups.rows[groups.starts[g] : groups.starts[g + 1]]  # [n]
        xs = x[span[0] : span[1]] if span is not None else x[rows]  # [n, in]
        shrunk = xs @ a[slot].T  # [n, S*r]
        parts = [
            shrunk[:, i * rank : (i + 1) * rank] @ b[slot, :, off : off + size]
            for i, (off, size) in enumerate(slices)
        ]  # [n, n_i] each
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [n, out]
        if span is not None:
            y[span[0] : span[1]] += delta.to(y.dtype)
        else:  # rows of a group are distinct: a gather-add-scatter is exact
            y[rows] += delta.to(y.dtype)


def lora_add(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    slices: Slices, groups: LoraGroups,
) -> None:  # fmt: skip
    """y += the LoRA terms, by the fastest route for the device."""
    if x.is_cuda:
        from kvflow.kernels.lora_triton import lora_add_triton  # CPU images lack Triton

        lora_add_triton(x, y, a, b, slices, groups.row_slots)
    elif lora_native.native_applies(x, y, a, b):
        lora_native.lora_add_native(x, y, a, b, slices, groups.row_slots)
    else:
        if native_calls.is_recording():  # the groups' host lists would be frozen in
            raise native_calls.NotReplayable("the LoRA torch route reads host lists")
        lora_add_reference(x, y, a, b, slices, groups)

"""Which adapter slot each row of the current forward uses, shared by every adapted layer.

The runner's LoRA feature sets it before a step's forward (one slot per scheduled
token, -1 for the base) and clears it when the step has no adapter. A layer sees
either every token of the step or, in the last layer after attention, only the logits
rows (`LlamaModel.forward`'s `output_rows`): `groups_for(n)` tells them apart by
count. When the two counts are equal the forward is run without `output_rows` (the
same work) so the count is never ambiguous.

A CPU decode graph (cpu_graphs.py) replays the LoRA kernel's call with the address it
was recorded with, so a decode step's row -> slot map goes to a buffer at a fixed
address (`reserve`, as large as the largest decode batch); the graphs keep a tape per
(size, `graph_variant`), adapted or not.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.kernels.lora import LoraGroups, group_rows


class LoraBatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False  # this forward has rows with an adapter
        self._token_slots = np.zeros(0, dtype=np.int64)
        self._all: LoraGroups | None = None
        self._rows: LoraGroups | None = None
        self._static = torch.zeros(0, dtype=torch.int32, device=device)

    def reserve(self, max_rows: int) -> None:
        """Steps of up to `max_rows` tokens keep their slots at one fixed address."""
        self._static = torch.zeros(max_rows, dtype=torch.int32, device=self.device)

    def graph_variant(self) -> bool:
        """Which decode graph serves this step: the adapted forward or the base's."""
        return self.active

    @property
    def replayable(self) -> bool:
        """A recorded forward reads this step's mapping: it sits in the fixed buffer."""
        return 0 < self.num_tokens <= len(self._static)

    def set(self, token_slots: np.ndarray) -> None:
        """token_slots [T]: each token's slot, -1 = base."""
        self._token_slots = token_slots
        self.active = bool((token_slots >= 0).any())
        out = self._static if len(token_slots) <= len(self._static) else None
        self._all = group_rows(token_slots, self.device, out) if self.active else None
        self._rows = None

    def set_output_rows(self, rows: torch.Tensor) -> None:
        """The rows the last layer keeps after attention (the logits rows)."""
        if self.active:
            self._rows = group_rows(self._token_slots[rows.cpu().numpy()], self.device)

    def clear(self) -> None:
        self.active = False
        self._all = self._rows = None

    @property
    def num_tokens(self) -> int:
        return len(self._token_slots)

    def groups_for(self, num_rows: int) -> LoraGroups:
        if num_rows == len(self._token_slots):
            assert self._all is not None
            return self._all
        assert self._rows is not None, "a layer saw rows the LoRA batch does not know"
        return self._rows

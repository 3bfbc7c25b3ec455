"""Multimodal RoPE (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position rows per token.

The rotary frequencies of a head, i = 0 .. D/2 - 1, are cut into three sections
(`mrope_section`, e.g. [16, 24, 24]): the first turns with the temporal position, the
second with the height, the third with the width::

    angle[token, i] = positions[section_of(i), token] * inv_freq[i]

A text token's three positions are equal, so for text M-RoPE is the ordinary RoPE of
that position: a step without image tokens passes the usual 1-D positions [T] (a decode
graph replays them), a step with them [3, T] (kvflow/mrope.py draws the layout).
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.gpu_worker.layers.rotary import Rope, RotaryEmbedding


class MRopeEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, params: dict[str, Any], max_position: int) -> None:
        super().__init__(head_dim, params, max_position)
        sections = [int(s) for s in params["mrope_section"]]
        if sum(sections) != self.rotary_dim // 2 or len(sections) != 3:
            raise ValueError(f"mrope_section {sections} must be 3 parts of {self.rotary_dim // 2}")
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
        self.section_rows: torch.Tensor
        self.register_buffer("section_rows", rows, persistent=False)  # [D/2]: 0, 1 or 2

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [T] (text) or [3, T] int64 -> Rope with tables in `dtype`."""
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        chosen = positions[self.section_rows].float()  # [D/2, T]: each frequency's row
        return self.tables(chosen.T * self.inv_freq.float(), dtype)

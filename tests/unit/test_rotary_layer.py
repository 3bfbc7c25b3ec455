"""The layer's rotation with whole-head tables equals the half-by-half formula bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvflow.gpu_worker.layers.rotary import Rope, RotaryEmbedding, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_head_tables_give_the_same_bits(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(64, {"rope_theta": 100000.0}, 4096)(torch.tensor([0, 5, 900]), dtype)
    assert rope.cos_full is not None
    x = torch.randn(3, 9, 64).to(dtype)
    halves = apply_rotary(x, Rope(rope.cos, rope.sin))  # the formula, on half tables
    assert torch.equal(apply_rotary(x, rope), halves)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin), -1)
    assert torch.equal(halves, expected)

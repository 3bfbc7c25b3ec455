"""The layer's rotations: whole-head tables equal the half-by-half formula bit for bit,
and the native in-place rotation of q and k (CPUs) equals both."""

from __future__ import annotations

import pytest
import torch

from kvflow.gpu_worker.layers.rotary import (
    Rope,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_qk,
    with_whole_head_tables,
)
from kvflow.kernels.cpu import elementwise


def _rope(dtype: torch.dtype) -> Rope:
    return RotaryEmbedding(64, {"rope_theta": 100000.0}, 4096)(torch.tensor([0, 5, 900]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_head_tables_give_the_same_bits(dtype: torch.dtype) -> None:
    halves = _rope(dtype)
    rope = with_whole_head_tables(halves.cos, halves.sin)
    x = torch.randn(3, 9, 64).to(dtype)
    by_halves = apply_rotary(x, Rope(rope.cos, rope.sin))  # the formula, on half tables
    assert torch.equal(apply_rotary(x, rope), by_halves)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin), -1)
    assert torch.equal(by_halves, expected)


@pytest.mark.native(elementwise._library() is not None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rotation_of_qkv_views_gives_the_same_bits(dtype: torch.dtype) -> None:
    """q and k as the qkv projection's row views (strided rows), rotated in place."""
    rope = _rope(dtype)
    assert rope.cos_full is None, "on CPUs the step skips the whole-head tables"
    qkv = torch.randn(3, (9 + 2 * 3) * 64).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(3, 9, 64), k.view(3, 3, 64)
    expected_q, expected_k = apply_rotary(q, rope), apply_rotary(k, rope)
    rotated_q, rotated_k = apply_rotary_qk(q, k, rope)
    assert rotated_q.data_ptr() == q.data_ptr(), "rotated in place"
    assert torch.equal(rotated_q, expected_q) and torch.equal(rotated_k, expected_k)


def test_unsupported_dtype_falls_back_to_torch() -> None:
    rope = _rope(torch.float16)
    q, k = torch.randn(3, 9, 64).half(), torch.randn(3, 3, 64).half()
    rotated_q, rotated_k = apply_rotary_qk(q, k, rope)
    assert torch.equal(rotated_q, apply_rotary(q, rope))
    assert torch.equal(rotated_k, apply_rotary(k, rope))
    assert rotated_q.data_ptr() != q.data_ptr()

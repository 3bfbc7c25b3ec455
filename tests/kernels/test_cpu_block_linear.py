"""The native GGUF block kernel: its weights equal gguf's dequantization bit for bit, and
its products equal F.linear on those weights; it steps aside where it does not apply."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvflow.kernels.cpu import block_linear as module
from kvflow.kernels.cpu import linear as linear_module
from kvflow.kernels.cpu.block_linear import (
    MAX_ROWS,
    BlockWeights,
    applies,
    block_linear,
    dequantize,
)

pytestmark = pytest.mark.native(module.available())


def _quantized(block_format: str, out_features: int, in_features: int, seed: int = 0):
    """(BlockWeights, float32 weight as gguf dequantizes it) of a random matrix."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
    weight[0] = 0.0  # a constant block: zero scale
    raw = gguf_quantize(weight, gguf.GGMLQuantizationType[block_format])
    expected = gguf_dequantize(raw, gguf.GGMLQuantizationType[block_format])
    blocks = BlockWeights.from_gguf(block_format, torch.from_numpy(raw), in_features)
    return blocks, torch.from_numpy(np.ascontiguousarray(expected)).reshape(weight.shape)


@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
def test_dequantize_is_bit_exact(block_format: str) -> None:
    blocks, expected = _quantized(block_format, 37, 160)
    actual = dequantize(blocks)
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, MAX_ROWS])
def test_matches_f_linear_on_dequantized_weights(block_format: str, rows: int) -> None:
    blocks, weight = _quantized(block_format, 37, 96, seed=rows)  # 37: not a multiple of R
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 96 + 16, generator=gen)
    x = wide[:, 8 : 8 + 96]  # a row stride larger than in_features
    bias = torch.randn(37, generator=gen)
    assert applies(x, blocks, bias)
    actual = block_linear(x, blocks, bias)
    assert actual.shape == (rows, 37)
    torch.testing.assert_close(actual, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(block_linear(x, blocks), F.linear(x, weight), atol=1e-4, rtol=1e-4)


def test_dispatcher_routes_rows_to_the_blocks_until_max_rows(monkeypatch) -> None:
    blocks, weight = _quantized("Q4_1", 16, 64)
    calls: list[int] = []
    original = module.block_linear

    def counting(x, blocks, bias=None):
        calls.append(x.shape[0])
        return original(x, blocks, bias)

    monkeypatch.setattr(module, "block_linear", counting)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        result = linear_module.linear(x, weight, None, blocks)
        torch.testing.assert_close(result, F.linear(x, weight), atol=1e-4, rtol=1e-4)
    assert calls == [1, MAX_ROWS]
    monkeypatch.setattr(linear_module, "GGUF_BLOCKS", False)
    linear_module.linear(torch.randn(1, 64), weight, None, blocks)
    assert calls == [1, MAX_ROWS]


def test_steps_aside_where_it_does_not_apply() -> None:
    blocks, _ = _quantized("Q8_0", 16, 64)
    assert not applies(torch.randn(MAX_ROWS + 1, 64), blocks, None)
    assert not applies(torch.randn(2, 64, dtype=torch.bfloat16), blocks, None)
    assert not applies(torch.randn(2, 32), blocks, None)  # wrong in_features
    assert not applies(torch.randn(2, 64), blocks, torch.randn(15))  # wrong bias
    assert not applies(torch.randn(3, 2, 64), blocks, None)
    with pytest.raises(ValueError, match="does not take"):
        block_linear(torch.randn(2, 32), blocks)


def test_malformed_blocks_are_rejected() -> None:
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not one of"):
        BlockWeights.from_gguf("Q5_K", raw, 32)
    with pytest.raises(ValueError, match="K % 32"):
        BlockWeights.from_gguf("Q8_0", raw, 48)
    with pytest.raises(ValueError):
        BlockWeights.from_gguf("Q8_0", raw, 64)  # 34 bytes per row hold one block, not two

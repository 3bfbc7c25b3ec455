"""The VNNI block kernel (block_vnni.cpp): on GGUF blocks in the tiled layout it computes
the int8 kernel's function (the same two activation digits and integer dots, so equal
to int8_linear's spec up to float32 summation order), and `--quantization gguf` layers
take it at one or two rows only. Needs AVX512-VNNI: skipped elsewhere (the routes it
replaces are then taken, and tested in their own files)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvflow.kernels.cpu import block_vnni as module
from kvflow.kernels.cpu import linear as linear_module
from kvflow.kernels.cpu.block_linear import BlockWeights, dequantize
from kvflow.kernels.cpu.block_vnni import FASTER_ROWS, MAX_ROWS, applies, block_vnni_linear
from kvflow.kernels.cpu.int8_linear import QuantWeights, int8_linear, reference

pytestmark = pytest.mark.native(module.available())


def _gguf_blocks(block_format: str, out_features: int, in_features: int, seed: int):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
    weight[0] = 0.0  # a constant block: zero scale
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[block_format])
    return BlockWeights.from_gguf(block_format, torch.from_numpy(raw), in_features)


def _assert_matches_spec(y: torch.Tensor, expected: torch.Tensor) -> None:
    # Integer dots are exact; float32 sums of a few hundred terms in another order.
    scale = expected.abs().max().clamp_min(1.0)
    assert (y - expected).abs().max() <= 2e-6 * scale, ((y - expected).abs().max(), scale)


# 37 outputs: a padded last tile; 96 and 224 inputs: odd block counts (3, 7), 576 even.
@pytest.mark.parametrize("in_features", [96, 224, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS])
@pytest.mark.parametrize("block_format", ["Q8_0", "Q4_0", "Q4_1"])
def test_matches_the_int8_spec(block_format: str, rows: int, in_features: int) -> None:
    blocks = _gguf_blocks(block_format, 37, in_features, seed=rows)
    weights = QuantWeights.from_blocks(blocks)
    generator = torch.Generator().manual_seed(in_features + rows)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, :32] = 0.0  # an all-zero activation block: zero digits, zero scale
    bias = torch.randn(37, generator=generator)
    _assert_matches_spec(block_vnni_linear(x, blocks, bias), reference(x, weights) + bias)


def test_strided_rows_and_large_values() -> None:
    blocks = _gguf_blocks("Q4_1", 40, 160, seed=7)
    wide = torch.randn(2, 320) * 1e4
    x = wide[:, :160]  # row stride 320
    _assert_matches_spec(
        block_vnni_linear(x, blocks), reference(x.contiguous(), QuantWeights.from_blocks(blocks))
    )


def test_close_to_float_linear_on_the_same_weights() -> None:
    blocks = _gguf_blocks("Q4_1", 64, 576, seed=3)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3))
    exact = x @ dequantize(blocks).T
    assert (block_vnni_linear(x, blocks) - exact).norm() / exact.norm() < 1e-4


def test_gguf_layers_take_it_at_few_rows_only() -> None:
    """`gguf` (QuantWeights from the blocks): rows <= FASTER_ROWS here, more rows the
    int8 kernel; `q8_0` weights (made from the float weights) never, nor layers without
    quantized weights (`none` stays exact)."""
    blocks = _gguf_blocks("Q4_1", 24, 64, seed=5)
    weight, weights = dequantize(blocks), QuantWeights.from_blocks(blocks)
    for rows in (1, FASTER_ROWS, FASTER_ROWS + 1):
        x = torch.randn(rows, 64)
        y = linear_module.linear(x, weight, None, blocks, weights)
        if rows <= FASTER_ROWS:
            assert torch.equal(y, block_vnni_linear(x, blocks))
        else:
            assert torch.equal(y, int8_linear(x, weights))
    x = torch.randn(1, 64)
    from_float = QuantWeights.from_float(weight)
    assert torch.equal(
        linear_module.linear(x, weight, None, blocks, from_float), int8_linear(x, from_float)
    )
    assert not torch.equal(
        linear_module.linear(x, weight, None, blocks), block_vnni_linear(x, blocks)
    )


def test_steps_aside_where_it_does_not_apply() -> None:
    blocks = _gguf_blocks("Q8_0", 16, 64, seed=1)
    assert applies(torch.randn(MAX_ROWS, 64), blocks, None)
    assert not applies(torch.randn(MAX_ROWS + 1, 64), blocks, None)
    assert not applies(torch.randn(2, 64, dtype=torch.bfloat16), blocks, None)
    assert not applies(torch.randn(2, 32), blocks, None)  # wrong in_features
    assert not applies(torch.randn(2, 64), blocks, torch.randn(15))  # wrong bias
    assert not applies(torch.randn(2, 128)[:, ::2], blocks, None)  # column stride 2

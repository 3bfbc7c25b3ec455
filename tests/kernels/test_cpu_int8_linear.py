"""The native quantized linear kernel (int8_linear.cpp): its activation digits equal the
torch spec exactly, its products equal the spec's float64 sums to float32 summation
order, on the build for this CPU (AVX512-VNNI where present) and on the portable build
(`-march=x86-64`: no vector ISA), which every x86 machine can run; so each test means
the same on every CPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvflow.kernels.cpu import int8_linear as module
from kvflow.kernels.cpu import linear as linear_module
from kvflow.kernels.cpu.block_linear import BlockWeights, dequantize
from kvflow.kernels.cpu.int8_linear import (
    PORTABLE_MARCH,
    QuantWeights,
    int8_linear,
    native_quantize_rows,
    quantize_rows,
    reference,
)

pytestmark = pytest.mark.native(module.library() is not None)

BUILDS = ["native", PORTABLE_MARCH]
# in_features covering every unit mix of the layout: 1, 2, 4, 4+2, 4+1, 4+2+1 blocks.
IN_FEATURES = [32, 64, 128, 192, 160, 224, 576]


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


@pytest.mark.parametrize("march", BUILDS)
def test_activation_digits_equal_the_spec(march: str) -> None:
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, digits 0
    x[1, 5] = 1000.0  # an outlier dominates its block
    native = native_quantize_rows(x, march)
    for actual, expected in zip(native[:3], quantize_rows(x)[:3], strict=True):
        assert torch.equal(actual, expected)
    torch.testing.assert_close(native[3], quantize_rows(x)[3], atol=1e-5, rtol=1e-6)
    xq, xr, e, _ = native
    approx = e.repeat_interleave(32, 1) * (xq.float() + xr.float() / 256)
    # Two digits: within one unit of the second (e / 256; half a unit but where the
    # clamp of +-128 to 127 takes one more).
    assert ((approx - x).abs() <= e.repeat_interleave(32, 1) / 256 + 1e-6).all()


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("in_features", IN_FEATURES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 130])
def test_q8_0_from_float_matches_spec(march: str, in_features: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(37, in_features, generator=gen)  # 37: not a multiple of a tile
    weight[1, :32] = 0.0
    weights = QuantWeights.from_float(weight)
    # Q8_0 rounds each weight to within half a step of its block: the stored half-float
    # scale, max|w| / 127 to 11 bits.
    assert weights.scales.dtype == torch.float16
    step = weight.reshape(37, -1, 32).abs().amax(-1) / 127
    assert ((weights.scales.float() - step).abs() <= step * 2**-11).all()
    stored = weights.scales.float().repeat_interleave(32, 1)
    assert ((weights.dequantize() - weight).abs() <= stored / 2 + 1e-7).all()
    wide = torch.randn(rows, in_features + 16, generator=gen)
    x = wide[:, 8 : 8 + in_features]  # a row stride larger than in_features
    bias = torch.randn(37, generator=gen)
    _assert_matches_spec(int8_linear(x, weights, bias, march), reference(x, weights, bias))


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("block_format", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 4, 67])
def test_gguf_blocks_match_spec(march: str, block_format: str, rows: int) -> None:
    blocks = _gguf_blocks(block_format, 37, 224, seed=rows)
    weights = QuantWeights.from_blocks(blocks)
    assert torch.equal(weights.dequantize(), dequantize(blocks))  # the same weights
    x = torch.randn(rows, 224, generator=torch.Generator().manual_seed(rows))
    _assert_matches_spec(int8_linear(x, weights, None, march), reference(x, weights))


@pytest.mark.parametrize("march", BUILDS)
def test_half_float_scales_of_every_kind(march: str) -> None:
    """Scales are halves: normal, subnormal (a block of max|w| < 127 * 2^-14), zero, and
    the largest; each build reads them as the spec does, on the 4-row tile and the tails."""
    weight = torch.randn(9, 224, generator=torch.Generator().manual_seed(5))
    weight[1, :32] *= 1e-4  # d ~ 2e-6: a subnormal half
    weight[2, 32:64] = 0.0
    weight[3, 64:96] *= 1e8  # d clamps to the largest half (65504)
    weights = QuantWeights.from_float(weight)
    d = weights.scales.float()
    assert 0 < d[1, 0] < 2**-14 and d[2, 1] == 0 and d[3, 2] == 65504
    for rows in (1, 4, 6):
        x = torch.randn(rows, 224, generator=torch.Generator().manual_seed(rows))
        _assert_matches_spec(int8_linear(x, weights, None, march), reference(x, weights))


def test_close_to_float_linear_on_the_same_weights() -> None:
    """With ~16-bit activations the error against F.linear on the dequantized weights
    is far below the weights' own quantization error (what the accuracy doc measures)."""
    blocks = _gguf_blocks("Q4_1", 64, 576, seed=3)
    weights = QuantWeights.from_blocks(blocks)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3))
    exact = x @ dequantize(blocks).T
    relative = (int8_linear(x, weights) - exact).norm() / exact.norm()
    assert relative < 1e-4


def test_bfloat16_rows_come_back_in_bfloat16() -> None:
    weights = QuantWeights.from_float(torch.randn(16, 64))
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = int8_linear(x, weights)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference(x.float(), weights), atol=0.1, rtol=1e-2)


def test_dispatcher_takes_quantized_layers_at_every_batch_size() -> None:
    weight = torch.randn(40, 96)
    weights = QuantWeights.from_float(weight)
    for rows in (1, 48, 300):
        x = torch.randn(rows, 96)
        y = linear_module.linear(x, weight, None, None, weights)
        assert torch.equal(y, int8_linear(x, weights))


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="in_features"):
        QuantWeights.from_float(torch.randn(4, 48))
    good = QuantWeights.from_float(torch.randn(4, 64))
    with pytest.raises(ValueError, match="offsets"):
        QuantWeights(8, good.codes, good.scales, good.offsets + 1, 64)


def test_gguf_layers_take_the_int8_kernel_only_where_it_is_ahead(monkeypatch) -> None:
    """GGUF blocks: Q4 at <= MAX_ROWS rows go to the int8 kernel; Q8_0 there read their
    exact blocks, and above MAX_ROWS every layer takes the exact float32 route (the
    blocks encode the layer's float32 weight exactly, and these routes are faster).
    The VNNI block kernel, ahead of both at 1-2 rows, is off here (its own tests)."""
    from kvflow.kernels.cpu import block_linear

    monkeypatch.setattr(linear_module, "GGUF_VNNI", False)
    for block_format in ("Q8_0", "Q4_1"):
        blocks = _gguf_blocks(block_format, 24, 64, seed=5)
        weight, weights = dequantize(blocks), QuantWeights.from_blocks(blocks)
        for rows in (1, block_linear.MAX_ROWS, block_linear.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            y = linear_module.linear(x, weight, None, blocks, weights)
            if rows > block_linear.MAX_ROWS:
                expected = linear_module.linear(x, weight)
            elif block_format == "Q8_0":
                expected = block_linear.block_linear(x, blocks)
            else:
                expected = int8_linear(x, weights)
            assert torch.equal(y, expected)

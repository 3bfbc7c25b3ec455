"""The native GGUF block kernel: its weights equal gguf's dequantization bit for bit, and
its products equal F.linear on those weights; it steps aside where it does not apply.
Checked on the build for this CPU (AVX-512 where present), an AVX2 build (where the CPU
runs one) and the portable build (`-march=x86-64`), so every path is tested on one machine."""

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
    MAX_ROWS_BF16,
    PORTABLE_MARCH,
    BlockWeights,
    applies,
    block_linear,
    dequantize,
)
from kvflow.kernels.cpu.native_build import _cpu_flags

pytestmark = pytest.mark.native(module.available())

AVX2_BUILD = ["haswell"] if " avx2" in _cpu_flags() and " fma" in _cpu_flags() else []
BUILDS = ["native", *AVX2_BUILD, PORTABLE_MARCH]


def _quantized(block_format: str, out_features: int, in_features: int, seed: int = 0):
    """(BlockWeights, float32 weight as gguf dequantizes it) of a random matrix."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
    weight[0] = 0.0  # a constant block: zero scale
    raw = gguf_quantize(weight, gguf.GGMLQuantizationType[block_format])
    expected = gguf_dequantize(raw, gguf.GGMLQuantizationType[block_format])
    blocks = BlockWeights.from_gguf(block_format, torch.from_numpy(raw), in_features)
    return blocks, torch.from_numpy(np.ascontiguousarray(expected)).reshape(weight.shape)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
def test_dequantize_is_bit_exact(block_format: str, march: str) -> None:
    blocks, expected = _quantized(block_format, 37, 160)
    actual = dequantize(blocks, march)
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
def test_tiled_layout_keeps_the_gguf_fields(block_format: str) -> None:
    """The packed tiles give back GGUF's codes, scales and offsets row by row (what the
    int8 kernel's `QuantWeights.from_blocks` reads), the padding rows of the last tile
    dropped."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((37, 96), dtype=np.float32)
    raw = gguf_quantize(weight, gguf.GGMLQuantizationType[block_format])
    blocks = BlockWeights.from_gguf(block_format, torch.from_numpy(raw), 96)
    assert blocks.packed.shape[0] == 10  # 37 rows in tiles of 4
    fields = torch.from_numpy(raw).reshape(37, 3, module.FORMATS[block_format][1])
    half = 4 if block_format == "Q4_1" else 2
    codes = fields[:, :, half:].reshape(37, -1)
    assert torch.equal(blocks.codes.view(torch.uint8), codes)
    scales = fields[:, :, :2].contiguous().view(torch.float16)[..., 0].float()
    assert torch.equal(blocks.scales, scales)
    if block_format == "Q4_1":
        assert blocks.mins is not None
        assert torch.equal(
            blocks.mins, fields[:, :, 2:4].contiguous().view(torch.float16)[..., 0].float()
        )
    else:
        assert blocks.mins is None


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, MAX_ROWS])
def test_matches_f_linear_on_dequantized_weights(block_format: str, rows: int, march: str) -> None:
    blocks, weight = _quantized(block_format, 37, 96, seed=rows)  # 37: not a multiple of 4
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 96 + 16, generator=gen)
    x = wide[:, 8 : 8 + 96]  # a row stride larger than in_features
    bias = torch.randn(37, generator=gen)
    assert applies(x, blocks, bias)
    actual = block_linear(x, blocks, bias, march)
    assert actual.shape == (rows, 37)
    torch.testing.assert_close(actual, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    expected = F.linear(x, weight)
    torch.testing.assert_close(block_linear(x, blocks, None, march), expected, atol=1e-4, rtol=1e-4)


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
    assert not applies(torch.randn(2, 64, dtype=torch.float16), blocks, None)
    bf16_limit = module.row_limit(torch.bfloat16)
    assert not applies(torch.randn(bf16_limit + 1, 64, dtype=torch.bfloat16), blocks, None)
    assert not applies(torch.randn(2, 64, dtype=torch.bfloat16), blocks, torch.randn(16))
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


@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
def test_bfloat16_rows_use_the_unrounded_weights(block_format: str) -> None:
    """bf16 rows (a bf16 model's decode step): widened, multiplied with the float32
    weights the blocks encode (not their bf16 rounding), the result rounded once; the
    dispatcher sends them here up to MAX_ROWS_BF16 rows."""
    blocks, weight = _quantized(block_format, 37, 160)
    x = torch.randn(MAX_ROWS_BF16, 160).to(torch.bfloat16)
    bias = torch.randn(37).to(torch.bfloat16)
    y = block_linear(x, blocks, bias)
    assert y.dtype == torch.bfloat16
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(y.double(), expected, atol=0.02, rtol=8e-3)  # bf16 output
    assert torch.equal(y, block_linear(x.float(), blocks, bias.float()).to(torch.bfloat16))
    routed = linear_module.linear(x, weight.to(torch.bfloat16), bias, blocks)
    assert torch.equal(routed, y)

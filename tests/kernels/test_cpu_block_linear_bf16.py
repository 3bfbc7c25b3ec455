"""The bf16 rows' block kernel (block_linear_bf16.h): the bf16 route's function, weights
rounded to bf16 from the blocks' exact values, float32 sums, y rounded once, for any row
count (16 rows a pass on vdpbf16ps, 8 on float32 vectors), and the dispatch that sends
a speculative verification step's k + 1 rows to it. Checked on the build for this CPU,
an AVX2 build (where the CPU runs one) and the portable build, so both paths run here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_block_linear import BUILDS, _quantized

from kvflow.kernels.cpu import block_linear as module
from kvflow.kernels.cpu import linear as linear_module
from kvflow.kernels.cpu.block_linear import MAX_ROWS_BF16, BlockWeights, applies, row_limit

pytestmark = pytest.mark.native(module.available())

ROWS = [*range(1, 17), 19, 35]  # 19, 35: more than one pass of 16 (or 8) rows


def _dot(x: torch.Tensor, blocks: BlockWeights, bias: torch.Tensor | None, march: str):
    """The bf16 rows' kernel itself, at any row count (the dispatch stops at row_limit)."""
    library = module._library(march)
    assert library is not None
    y = torch.empty(x.shape[0], blocks.out_features, dtype=torch.bfloat16)
    status = library.kvflow_block_linear_bf16_dot(
        blocks.code, x.data_ptr(), blocks.address, None if bias is None else bias.data_ptr(),
        y.data_ptr(), x.shape[0], blocks.in_features, blocks.out_features, x.stride(0),
    )  # fmt: skip
    assert status == 0
    return y


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bf16 model's function in float64: bf16 weights and rows, y rounded once."""
    y = F.linear(x.double(), weight.to(torch.bfloat16).double())
    return (y + (0 if bias is None else bias.double())).to(torch.bfloat16)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:  # bf16 steps between a and b (same sign)
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
@pytest.mark.parametrize("rows", ROWS)
def test_matches_the_bf16_route(block_format: str, rows: int, march: str) -> None:
    """Odd shapes (37 outputs: a padded tile; 160 inputs: 5 blocks), a row stride wider
    than the row, with and without bias: within one bf16 step of the exact result (the
    float32 sum's order decides the rounding of near-ties)."""
    blocks, weight = _quantized(block_format, 37, 160, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160 + 32, generator=gen).to(torch.bfloat16)[:, 16 : 16 + 160]
    bias = torch.randn(37, generator=gen).to(torch.bfloat16)
    for b in (bias, None):
        y, expected = _dot(x, blocks, b, march), _reference(x, weight, b)
        close = (y.float() - expected.float()).abs() <= 1e-3 + 8e-3 * expected.float().abs()
        assert bool(close.all()), (y - expected).abs().max()


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("block_format", sorted(module.FORMATS))
def test_weights_are_rounded_to_bf16(block_format: str, march: str) -> None:
    """Rows of two ones: y = w_a + w_b, exact in float32 whichever the order, so the
    kernel must give bf16(bf16(w_a) + bf16(w_b)) bit for bit (the bf16 model's weights),
    not bf16(w_a + w_b) (the unrounded weights of the one- and two-row kernel)."""
    blocks, weight = _quantized(block_format, 21, 96, seed=7)
    gen = torch.Generator().manual_seed(7)
    rows = 12
    x = torch.zeros(rows, 96, dtype=torch.bfloat16)
    for i in range(rows):
        x[i, torch.randperm(96, generator=gen)[:2]] = 1.0
    y = _dot(x, blocks, None, march)
    assert _ulps(y, _reference(x, weight, None)) == 0
    unrounded = F.linear(x.double(), weight.double()).to(torch.bfloat16)
    assert not torch.equal(y, unrounded) or block_format == "Q4_0"  # Q4_0: few bits, may tie


def test_dispatch_sends_verification_rows_to_the_kernel(monkeypatch) -> None:
    """Up to MAX_ROWS_BF16 rows: the unrounded kernel; then up to row_limit the bf16
    rows' kernel (both read the blocks); beyond, the packed or plain bf16 route."""
    blocks, weight = _quantized("Q4_1", 37, 96)
    limit = row_limit(torch.bfloat16)
    assert limit == (module.MAX_ROWS_BF16_DOT if module.bf16_dot_native() else MAX_ROWS_BF16)
    for rows in range(1, limit + 2):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        routed = linear_module.linear(x, weight.to(torch.bfloat16), None, blocks)
        assert applies(x, blocks, None) == (rows <= limit)
        if rows <= MAX_ROWS_BF16:
            assert torch.equal(routed, module.block_linear(x, blocks))
        elif rows <= limit:
            assert torch.equal(routed, _dot(x, blocks, None, "native"))
        else:
            assert torch.equal(routed, F.linear(x, weight.to(torch.bfloat16)))

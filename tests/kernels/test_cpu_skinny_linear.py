"""The native small-batch linear layer against F.linear, and when it steps aside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import skinny_linear as module
from kvflow.kernels.cpu.skinny_linear import MAX_ROWS, native_applies, skinny_linear

pytestmark = pytest.mark.native(module._library() is not None)
# Against an fp32 reference: fp32 sums in another order; bf16 output rounded once.
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [(64, 96, False), (100, 37, True), (576, 5, True)],  # K % 8 != 0, N % R != 0, N < R
)
def test_matches_f_linear(dtype, rows, in_features, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    # x as a column slice of a wider tensor: a row stride larger than in_features.
    wide = torch.randn(rows, in_features + 16, generator=gen).to(dtype)
    x = wide[:, 8 : 8 + in_features]
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    assert native_applies(x, weight, b)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    actual = skinny_linear(x, weight, b)
    assert actual.dtype == dtype and actual.shape == (rows, out_features)
    torch.testing.assert_close(actual.float(), expected, **TOLERANCES[dtype])


def test_steps_aside_where_it_does_not_apply():
    weight = torch.randn(16, 32)
    many_rows = torch.randn(MAX_ROWS + 1, 32)
    assert not native_applies(many_rows, weight, None)
    assert not native_applies(torch.randn(2, 32, dtype=torch.float16), weight.half(), None)
    assert not native_applies(torch.randn(2, 32), weight.t().contiguous().t(), None)
    assert not native_applies(torch.randn(2, 32), weight.bfloat16(), None)  # mixed dtypes
    assert not native_applies(torch.randn(3, 2, 32), weight, None)  # not 2-D
    # ... and then the result is F.linear's, whatever the shape.
    x = torch.randn(3, 2, 32)
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight))


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="do not match"):
        skinny_linear(torch.randn(2, 32), torch.randn(16, 24))

"""RMSNorm and fused residual-add + RMSNorm against their references."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)


def _inputs(device, hidden, dtype):
    gen = torch.Generator().manual_seed(0)
    # x is a strided view (every other row of a bigger tensor), as a slice of a batch is.
    x = (3 * torch.randn(10, hidden, generator=gen)).to(dtype).to(device)[::2]
    residual = torch.randn(5, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(device, assert_close, hidden, dtype):
    x, _, weight = _inputs(device, hidden, dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(device, assert_close, hidden, dtype):
    x, residual, weight = _inputs(device, hidden, dtype)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    # The residual add is one rounding of an exact fp32 sum on both sides: bit-identical.
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, expected_out)

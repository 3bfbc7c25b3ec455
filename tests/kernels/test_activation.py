"""SiLU-and-mul against its reference."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize(
    ("intermediate", "dtype"),
    [
        (64, torch.float32),
        (40, torch.bfloat16),  # not a power of two: a masked tail
        (1100, torch.float32),  # more than one 1024-wide column block per row
    ],
)
def test_silu_and_mul(device, assert_close, intermediate, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(3, 2 * intermediate, generator=gen)).to(dtype).to(device)
    out = silu_and_mul(x)
    assert out.shape == (3, intermediate) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(x))

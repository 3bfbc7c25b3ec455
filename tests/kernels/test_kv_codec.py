"""The quantized KV row format (kernels/kv_codec.py): layout, error bounds, zero rows."""

import pytest
import torch

from kvflow.kernels import kv_codec

# Worst relative error per element against the row's max |x|: half a step of the code grid
# (int8: 0.5/127), or the format's relative precision at the top of the range (e4m3: 2^-4,
# e5m2: 2^-3), whichever is coarser for the largest code.
BOUNDS = {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}


@pytest.mark.parametrize("name", list(kv_codec.CODEC_DTYPES))
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_bounded_per_row(name: str, src_dtype: torch.dtype) -> None:
    dtype = kv_codec.CODEC_DTYPES[name]
    torch.manual_seed(0)
    x = (torch.randn(9, 3, 64) * torch.logspace(-3, 3, 9)[:, None, None]).to(src_dtype)
    rows = kv_codec.quantize_rows(x, dtype)
    assert rows.shape == (9, 3, 68) and rows.dtype == dtype
    assert kv_codec.head_dim_of(rows) == 64
    back = kv_codec.dequantize_rows(rows)
    row_max = x.float().abs().amax(-1, keepdim=True)
    assert ((back - x.float()).abs() <= BOUNDS[name] * row_max).all()
    # The row's largest element is represented without saturating.
    top = x.float().abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, top).abs(), row_max, rtol=BOUNDS[name])


@pytest.mark.parametrize("name", list(kv_codec.CODEC_DTYPES))
def test_scale_is_the_trailing_float32_of_each_row(name: str) -> None:
    dtype = kv_codec.CODEC_DTYPES[name]
    x = torch.zeros(2, 1, 8)
    x[1, 0, 3] = -2.5
    rows = kv_codec.quantize_rows(x, dtype)
    raw = rows.view(torch.uint8)
    scales = raw[..., 8:].contiguous().view(torch.float32).flatten().tolist()
    assert scales == [0.0, pytest.approx(2.5 / kv_codec._QMAX[dtype])]
    assert kv_codec.dequantize_rows(rows)[0].abs().max() == 0  # a zero row stays zero
    assert kv_codec.dequantize_rows(rows)[1, 0, 3].item() == pytest.approx(-2.5)


def test_float_caches_keep_their_width() -> None:
    assert kv_codec.row_width(64, torch.bfloat16) == 64
    assert kv_codec.row_width(64, torch.int8) == 68
    assert not kv_codec.is_quantized(torch.float32)

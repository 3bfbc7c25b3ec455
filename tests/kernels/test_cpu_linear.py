"""The CPU linear dispatcher: each route gives F.linear's result, and each call takes the
route its rows and dtype call for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import bf16_gemm, packed_linear, skinny_linear
from kvflow.kernels.cpu import linear as module
from kvflow.kernels.cpu.linear import linear, onednn_applies

needs_onednn = pytest.mark.skipif(
    not module._onednn_available(), reason="torch built without oneDNN"
)


def _inputs(rows: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + rows)
    wide = torch.randn(rows, 600, generator=gen).to(dtype)
    x = wide[:, 10:586]  # 576 features, row stride 600: a view, as layers may pass
    weight = torch.randn(1000, 576, generator=gen).to(dtype)
    b = torch.randn(1000, generator=gen).to(dtype) if bias else None
    return x, weight, b


def _route_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records which implementation each `linear` call reached."""
    taken: list[str] = []
    native, pointwise = module.run_native, torch.ops.mkldnn._linear_pointwise

    def spy_native(*args):
        taken.append("native")
        return native(*args)

    class SpyOps:
        @staticmethod
        def _linear_pointwise(*args):
            taken.append("onednn")
            return pointwise(*args)

    monkeypatch.setattr(module, "run_native", spy_native)
    monkeypatch.setattr(module.torch.ops, "mkldnn", SpyOps)
    return taken


@needs_onednn
@pytest.mark.parametrize("rows", [9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_batches_match_f_linear_through_onednn(rows, bias, monkeypatch):
    x, weight, b = _inputs(rows, torch.float32, bias)
    taken = _route_spy(monkeypatch)
    actual = linear(x, weight, b)
    assert taken == ["onednn"]
    assert actual.shape == (rows, 1000) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


@pytest.mark.native(skinny_linear._library() is not None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_take_the_native_kernel(dtype, monkeypatch):
    x, weight, b = _inputs(skinny_linear.MAX_ROWS, dtype, bias=True)
    taken = _route_spy(monkeypatch)
    actual = linear(x, weight, b)
    assert taken == ["native"]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        actual.float(), F.linear(x.float(), weight.float(), b.float()), atol=tol, rtol=tol
    )


@pytest.mark.parametrize(
    "case",
    ["bfloat16 batch", "switched off", "3-d input"],
)
def test_other_calls_go_to_f_linear(case, monkeypatch):
    dtype = torch.bfloat16 if case == "bfloat16 batch" else torch.float32
    x, weight, b = _inputs(32, dtype, bias=True)
    if case == "switched off":
        monkeypatch.setattr(module, "ONEDNN_FLOAT32", False)
    if case == "3-d input":
        x = x.contiguous().view(4, 8, 576)
    assert not onednn_applies(x, weight, b)
    taken = _route_spy(monkeypatch)
    actual = linear(x, weight, b)
    assert taken == []
    torch.testing.assert_close(actual, F.linear(x, weight, b))


def test_empty_batch() -> None:
    x, weight, b = _inputs(0, torch.float32, bias=True)
    assert linear(x, weight, b).shape == (0, 1000)


needs_packing = pytest.mark.skipif(
    not packed_linear.available(torch.float32), reason="torch built without oneDNN"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_give_f_linear_results(rows, dtype):
    """bfloat16: bit for bit (F.linear runs the same oneDNN kernel on the plain weight).
    float32: F.linear goes to MKL, so up to summation order."""
    if not packed_linear.available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    x, weight, b = _inputs(rows, dtype, bias=True)
    packed_weight = packed_linear.pack(weight)
    assert packed_weight is not None
    actual = linear(x, torch.empty(0, dtype=dtype), b, packed_weight=packed_weight)
    assert actual.shape == (rows, 1000) and actual.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(actual, F.linear(x, weight, b))
    else:
        torch.testing.assert_close(actual, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


@needs_packing
def test_a_packed_layer_refuses_input_it_cannot_take():
    x, weight, _ = _inputs(4, torch.float32, bias=False)
    packed_weight = packed_linear.pack(weight)
    with pytest.raises(ValueError, match="packed"):
        linear(x.bfloat16(), weight, packed_weight=packed_weight)


def test_only_cpu_float_weights_are_packed():
    assert packed_linear.pack(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert packed_linear.pack(torch.zeros(4, dtype=torch.float32)) is None


@pytest.mark.native(bf16_gemm._library() is not None)
@pytest.mark.skipif(not bf16_gemm.available(), reason="this CPU has no AVX512_BF16")
@pytest.mark.parametrize("rows", [1, 64])
def test_bf16_panels_take_the_native_gemm(rows, monkeypatch):
    """A layer packed for the native bf16 GEMM goes there, with its bias, whatever the
    rows; oneDNN is not called (its plain weight may be freed)."""
    x, weight, b = _inputs(rows, torch.bfloat16, bias=True)
    packed_weight = bf16_gemm.pack(weight)
    assert packed_weight is not None
    taken = _route_spy(monkeypatch)
    actual = linear(x, torch.empty(0, dtype=torch.bfloat16), b, packed_weight=packed_weight)
    assert taken == [] and actual.shape == (rows, 1000)
    expected = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(actual.float(), expected, atol=0.1, rtol=1e-2)

"""The fused CPU elementwise kernels against the torch layers they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import kv_codec
from kvflow.kernels.cpu import elementwise, native_build

pytestmark = pytest.mark.native(elementwise._library() is not None)


@pytest.fixture(autouse=True, params=["module", "ctypes"])
def calls(request, monkeypatch):
    """Every test twice: kernels called through the CPython module and through ctypes."""
    if request.param == "ctypes":
        library = native_build.load_bound("elementwise", elementwise._SIGNATURES)
        monkeypatch.setattr(elementwise, "_library", lambda: library)
    elif native_build.load_module("elementwise") is None:
        pytest.skip("no Python headers: the kernels are called through ctypes only")
    return request.param


# fp32: another summation order and exp; bf16: at most about one bf16 ulp after rounding.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2},
}


def _torch_rms_norm(x, weight, eps, residual=None):
    """gpu_worker/layers/norm.py's torch path (Hugging Face's numerics)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (13, 100), (4, 3, 64)])  # 100: not a multiple of 8
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, shape, with_residual):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    weight = torch.rand(shape[-1], generator=gen).to(dtype) + 0.5
    expected, expected_sum = _torch_rms_norm(x, weight, 1e-5, residual)
    out, summed = elementwise.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    if with_residual:
        assert summed is not None and torch.equal(summed, expected_sum)  # one rounding: exact
    else:
        assert summed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (9, 2 * 37)])
def test_silu_and_mul_matches_torch(dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(elementwise.silu_and_mul(x), F.silu(gate) * up, **TOLERANCES[dtype])


def test_extreme_gates_stay_finite():
    x = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = elementwise.silu_and_mul(x)
    torch.testing.assert_close(out, F.silu(x[:, :5]) * x[:, 5:], atol=1e-5, rtol=1e-5)


def test_applies_only_to_contiguous_cpu_tensors_of_one_supported_dtype():
    x = torch.randn(4, 8)
    assert elementwise.applies(x, torch.randn(8))
    assert not elementwise.applies(x.t(), torch.randn(4))
    assert not elementwise.applies(x.half())
    assert not elementwise.applies(x, torch.randn(8).bfloat16())


def test_mismatched_weight_is_rejected():
    with pytest.raises(ValueError, match="do not match"):
        elementwise.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


def _cache_and_rows(dtype, num_tokens=5, kv_heads=3, head_dim=64):
    gen = torch.Generator().manual_seed(num_tokens)
    cache = torch.randn(2, 4, 16, kv_heads, head_dim, generator=gen).to(dtype)  # 64 slots
    # key and value as views of one fused projection, as the model hands them over
    kv = torch.randn(num_tokens, 2 * kv_heads * head_dim, generator=gen).to(dtype)
    key, value = (t.view(num_tokens, kv_heads, head_dim) for t in kv.chunk(2, dim=-1))
    return cache, key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy_and_skips_padding(dtype):
    cache, key, value = _cache_and_rows(dtype)
    slots = torch.tensor([7, -1, 63, 0, 20])
    expected = cache.clone()
    stored = slots >= 0
    for plane, rows in ((0, key), (1, value)):
        expected[plane].view(64, 3, 64).index_copy_(0, slots[stored], rows[stored])
    assert elementwise.store_applies(key, value, cache, slots)
    elementwise.store_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing():
    cache, key, value = _cache_and_rows(torch.float32, num_tokens=2)
    before = cache.clone()
    with pytest.raises(ValueError, match="out of range"):
        elementwise.store_kv(key, value, cache, torch.tensor([3, 64]))
    assert torch.equal(cache, before)


def test_store_applies_only_to_matching_layouts():
    cache, key, value = _cache_and_rows(torch.float32)
    slots = torch.arange(5)
    assert not elementwise.store_applies(key, value, cache, slots.int())  # int32 slots
    assert not elementwise.store_applies(key.bfloat16(), value, cache, slots)
    assert not elementwise.store_applies(key.transpose(1, 2), value, cache, slots)
    assert not elementwise.store_applies(key, value, cache[:, :2], slots)  # not contiguous


def test_store_kv_refuses_rows_of_another_width_than_the_cache():
    cache, key, value = _cache_and_rows(torch.float32, num_tokens=2)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="store_kv failed with status 2"):
        elementwise.store_kv(key[:, :2], value[:, :2], cache, torch.tensor([3, 4]))
    assert torch.equal(cache, before)


def test_module_calls_check_their_arguments(calls):
    if calls == "ctypes":
        pytest.skip("ctypes checks its own arguments")
    module = native_build.load_module("elementwise")
    with pytest.raises(TypeError, match="takes 5 arguments"):
        module.kvflow_silu_and_mul(0, 0, 0, 1)
    with pytest.raises(TypeError):
        module.kvflow_silu_and_mul(0, "not a pointer", 0, 1, 8)


def test_tensors_off_the_cpu_never_build_the_cpu_kernels(monkeypatch):
    """A CUDA run asks `applies` every layer: it must answer before loading anything."""

    def refuse():
        raise AssertionError("the CPU kernels were loaded for tensors off the CPU")

    monkeypatch.setattr(elementwise, "_library", refuse)
    x = torch.empty(4, 8, device="meta")
    assert not elementwise.applies(x, torch.empty(8, device="meta"))
    q, k = torch.empty(1, 9, 64, device="meta"), torch.empty(1, 3, 64, device="meta")
    assert not elementwise.rotary_applies(q, k, torch.empty(1, 32, device="meta"))


CODECS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _stored_rows(cache, plane, slots):
    """The rows at `slots` of plane 0 (K) or 1 (V), as raw bytes."""
    _, _, _, kv_heads, row = cache.shape
    return cache[plane].reshape(-1, kv_heads, row)[slots].view(torch.uint8)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 36])
def test_quantizing_store_is_bit_exact_with_kv_codec(codec, dtype, head_dim):
    """Codes and scale bytes equal kv_codec.quantize_rows's, for rows over 11 decades
    (fp8 subnormal codes included), an all-zero row, a -0.0 row; padding skipped;
    head_dim 36: the 8-lane loop and its scalar tail."""
    gen = torch.Generator().manual_seed(1)
    rows, kv_heads = 40, 3
    magnitudes = torch.logspace(-9, 3, rows).view(rows, 1, 1)
    key = (torch.randn(rows, kv_heads, head_dim, generator=gen) * magnitudes).to(dtype)
    value = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    key[3] = 0.0
    key[4, 1] = -0.0
    key[5, 0, :8] = 1e-30  # far below the row's scale: zero / subnormal codes
    cache = torch.zeros(2, 8, 8, kv_heads, head_dim + 4, dtype=codec)
    slots = torch.randperm(64, generator=gen)[:rows]
    slots[7] = -1
    before = cache.clone()
    assert elementwise.store_applies(key, value, cache, slots)
    elementwise.store_kv(key, value, cache, slots)
    stored = slots >= 0
    for plane, x in ((0, key), (1, value)):
        expected = kv_codec.quantize_rows(x[stored], codec).view(torch.uint8)
        assert torch.equal(_stored_rows(cache, plane, slots[stored]), expected)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[stored]] = False
    for plane in (0, 1):
        assert torch.equal(
            _stored_rows(cache, plane, untouched), _stored_rows(before, plane, untouched)
        )


@pytest.mark.parametrize("codec", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_store_rounds_ties_to_even_as_torch(codec):
    """Every code of the format, the midpoints between neighbours (ties) and one float32
    ulp either side of them, normal and subnormal: a row led by qmax has scale 1, so
    these reach the rounding as they are."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(codec).float()  # +0 .. +max
    codes = codes[torch.isfinite(codes) & (codes <= QMAX[codec])]
    mids = (codes[:-1] + codes[1:]) / 2
    near = torch.cat([mids, mids.nextafter(torch.zeros(())), mids.nextafter(mids * 2 + 1)])
    values = torch.cat([codes, near])
    values = torch.cat([values, -values])
    per_row = 63
    pad = (-len(values)) % per_row
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per_row)
    rows = torch.cat([torch.full((len(values), 1), QMAX[codec]), values], dim=1)
    key = rows.view(-1, 1, 64)
    cache = torch.zeros(2, 1, len(key), 1, 68, dtype=codec)
    slots = torch.arange(len(key))
    elementwise.store_kv(key, key, cache, slots)
    expected = kv_codec.quantize_rows(key, codec).view(torch.uint8)
    assert torch.equal(_stored_rows(cache, 0, slots), expected)


def test_quantized_store_applies_only_to_matching_layouts():
    key = torch.randn(5, 3, 64)
    cache = torch.zeros(2, 4, 16, 3, 68, dtype=torch.int8)
    slots = torch.arange(5)
    assert elementwise.store_applies(key, key, cache, slots)
    assert elementwise.store_applies(key.bfloat16(), key.bfloat16(), cache, slots)
    assert not elementwise.store_applies(key.half(), key.half(), cache, slots)  # float16 rows
    assert not elementwise.store_applies(key, key.bfloat16(), cache, slots)  # mixed
    assert not elementwise.store_applies(key[:, :, :60], key[:, :, :60], cache, slots)
    assert not elementwise.store_applies(key, key, cache[:, :2], slots)  # not contiguous


def test_quantized_store_refuses_bad_slots_and_widths():
    key = torch.randn(2, 3, 64)
    cache = torch.zeros(2, 4, 16, 3, 68, dtype=torch.float8_e4m3fn)
    before = cache.clone().view(torch.uint8)
    with pytest.raises(ValueError, match="out of range"):
        elementwise.store_kv(key, key, cache, torch.tensor([3, 64]))
    with pytest.raises(RuntimeError, match="store_kv failed with status 2"):
        elementwise.store_kv(key[:, :2], key[:, :2], cache, torch.tensor([3, 4]))
    assert torch.equal(cache.view(torch.uint8), before)

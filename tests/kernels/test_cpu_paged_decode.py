"""The native CPU paged decode attention against its torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_builds import MARCHES, skip_unless_runs

from kvflow.kernels import kv_codec
from kvflow.kernels.cpu.native_build import cpu_flags
from kvflow.kernels.cpu.paged_decode import load_paged_decode, paged_decode_attention_ref

kernel = load_paged_decode()
pytestmark = pytest.mark.native(kernel is not None)

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def _random_case(num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, gen):
    """Requests with ragged lengths on shuffled, non-adjacent blocks; the query is a view
    into a fused QKV projection (token stride > heads * head_dim), as in the models."""
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1  # one unused padding column
    num_blocks = len(seq_lens) * max_blocks + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    block_ids = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    block_tables = block_ids.view(len(seq_lens), max_blocks).to(torch.int32)
    num_tokens = len(seq_lens) + 2  # two rows that are not decodes (must stay untouched)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    return (
        query.to(dtype) if dtype != torch.float32 else query,
        kv_cache.to(dtype),
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 80, 8), (6, 1, 96, 32), (4, 2, 36, 4)],
)
@pytest.mark.parametrize("window", [None, 7])
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, window):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    seq_lens = [1, 17, block_size, 5, 70, 2 * block_size + 1]
    query, kv_cache, block_tables, lens = _random_case(
        num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, gen
    )
    # Decodes in a different order from the requests, and one request not decoded.
    req_indices = torch.tensor([3, 0, 5, 1, 4], dtype=torch.int32)
    token_rows = torch.tensor([0, 2, 3, 5, 6], dtype=torch.int32)
    expected = torch.full_like(query, 7.0)
    actual = expected.clone()
    args = (kv_cache, block_tables, lens, req_indices, token_rows)
    paged_decode_attention_ref(query, *args, expected, 0.125, window)
    kernel(query, *args, actual, 0.125, window)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
    untouched = [r for r in range(query.shape[0]) if r not in token_rows.tolist()]
    assert (actual[untouched] == 7.0).all()


def test_large_scores_are_stable():
    """Scores in the thousands: the max is subtracted before exp (no overflow to inf/NaN)."""
    gen = torch.Generator().manual_seed(0)
    query, kv_cache, block_tables, lens = _random_case(2, 1, 64, 16, [40], torch.float32, gen)
    query = query * 100
    rows = torch.tensor([0], dtype=torch.int32)
    expected, actual = torch.zeros_like(query), torch.zeros_like(query)
    paged_decode_attention_ref(query, kv_cache, block_tables, lens, rows, rows, expected, 1.0)
    kernel(query, kv_cache, block_tables, lens, rows, rows, actual, 1.0)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"req_indices": torch.tensor([9], dtype=torch.int32)}, "req_indices out of range"),
        ({"token_rows": torch.tensor([99], dtype=torch.int32)}, "token_rows out of range"),
        ({"seq_lens": torch.tensor([500], dtype=torch.int32)}, "beyond its block table"),
        ({"block_tables": torch.zeros(1, 4, dtype=torch.int64)}, "int32"),
    ],
)
def test_rejects_what_would_read_out_of_bounds(change, message):
    gen = torch.Generator().manual_seed(0)
    query, kv_cache, block_tables, lens = _random_case(2, 1, 64, 16, [40], torch.float32, gen)
    args = {
        "query": query,
        "kv_cache": kv_cache,
        "block_tables": block_tables,
        "seq_lens": lens,
        "req_indices": torch.tensor([0], dtype=torch.int32),
        "token_rows": torch.tensor([0], dtype=torch.int32),
        "out": torch.zeros_like(query),
    }
    with pytest.raises(ValueError, match=message):
        kernel(**(args | change), scale=1.0)


def _kernel_for(march: str):
    skip_unless_runs(march)
    built = load_paged_decode(march)
    if built is None:
        pytest.skip(f"no -march={march} build here")
    return built


def _check_against_reference(kern, num_heads, num_kv_heads, head_dim, block_size, seq_lens,
                             dtype, window=None):  # fmt: skip
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + block_size)
    query, kv_cache, block_tables, lens = _random_case(
        num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, gen
    )
    rows = torch.arange(len(seq_lens), dtype=torch.int32)
    expected = torch.zeros(query.shape, dtype=torch.float32)
    actual = torch.full_like(query, 7.0)
    args = (kv_cache, block_tables, lens, rows, rows)
    scale = head_dim**-0.5
    paged_decode_attention_ref(query, *args, expected, scale, window)
    kern(query, *args, actual, scale, window)
    n = len(seq_lens)
    torch.testing.assert_close(actual[:n].float(), expected[:n], **TOLERANCES[dtype])
    assert (actual[n:] == 7.0).all()
    return actual[:n].float(), expected[:n]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_path_and_head_group(march, dtype, group):
    """GQA ratios 1..8 (the AVX-512 weights go by groups of at most 4 heads), on each of
    the kernel's paths; lengths around the 16-row tile (1, 15, 16, 17, 33) on blocks of 5,
    so tiles span blocks; head_dim 96 = a 64-column and a 32-column group."""
    kern = _kernel_for(march)
    _check_against_reference(kern, 2 * group, 2, 96, 5, [1, 15, 16, 17, 33, 70], dtype)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize(
    ("head_dim", "block_size", "window"),
    [
        (32, 1, None),
        (64, 16, None),
        (64, 16, 20),
        (128, 32, 17),
        (256, 16, None),
        (48, 8, None),
        (80, 16, 9),
    ],
)
def test_every_path_head_dims_and_windows(march, head_dim, block_size, window):
    """head_dim 32..256 (48 and 80 are not multiples of 32: the portable loops even on
    AVX-512), block sizes 1..32, sliding windows that start mid-tile and mid-block."""
    kern = _kernel_for(march)
    for dtype in (torch.float32, torch.bfloat16):
        _check_against_reference(kern, 6, 2, head_dim, block_size, [3, 16, 45, 100], dtype, window)


@pytest.mark.parametrize("march", MARCHES)
def test_bf16_error_is_that_of_bf16_rounding(march):
    """bfloat16 on each path: the weights of V may be rounded to bf16 (AVX512_BF16, as
    FlashAttention and torch's CPU flash attention do), which must cost less than the
    bf16 rounding of the output itself (measured: 1.4x the error of that rounding alone,
    1.0x without AVX512_BF16); float32 stays far tighter."""
    kern = _kernel_for(march)
    actual, expected = _check_against_reference(
        kern, 9, 3, 64, 16, [300, 290, 64, 7], torch.bfloat16
    )
    rounding_error = (expected.bfloat16().float() - expected).abs().mean()
    assert (actual - expected).abs().mean() < 1.6 * rounding_error
    f32_actual, f32_expected = _check_against_reference(
        kern, 9, 3, 64, 16, [300, 290, 64, 7], torch.float32
    )
    assert (f32_actual - f32_expected).abs().max() < 1e-5


CODECS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# Against the float attention over the dequantized cache: float32 queries carry the int16
# rounding of the query (AVX512_VNNI int8 keys, relative 2^-16 of its largest element)
# and the int16 weights of int8 values (2^-16 of each tile's largest); bf16 as above.
QUANT_TOLERANCES = {
    torch.float32: {"atol": 2e-4, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def _sdpa_reference(query, kv_cache, block_tables, seq_lens, rows, scale, window):
    """kv_codec.dequantize_rows, then SDPA per decode over its gathered context."""
    values = kv_codec.dequantize_rows(kv_cache)  # [2, blocks, block_size, KH, D]
    block_size, num_kv_heads = values.shape[2], values.shape[3]
    out = torch.zeros(len(rows), *query.shape[1:])
    for i, row in enumerate(rows.tolist()):
        n = int(seq_lens[i])
        first = max(0, n - window) if window else 0
        positions = torch.arange(first, n)
        slots = block_tables[i].long()[positions // block_size] * block_size
        slots += positions % block_size
        k, v = (values[p].reshape(-1, num_kv_heads, values.shape[-1])[slots] for p in (0, 1))
        q = query[row].float().unsqueeze(1)  # [H, 1, D]
        attended = F.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True
        )
        out[i] = attended.squeeze(1)
    return out


def _check_quantized(kern, codec, dtype, num_heads, num_kv_heads, head_dim, block_size,
                     seq_lens, window=None):  # fmt: skip
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + block_size)
    query, raw, block_tables, lens = _random_case(
        num_heads, num_kv_heads, head_dim, block_size, seq_lens, torch.float32, gen
    )
    kv_cache = kv_codec.quantize_rows(raw, codec)
    query = query.to(dtype)
    rows = torch.arange(len(seq_lens), dtype=torch.int32)
    assert kern.supports(query, kv_cache)
    actual = torch.full_like(query, 7.0)
    scale = head_dim**-0.5
    kern(query, kv_cache, block_tables, lens, rows, rows, actual, scale, window)
    expected = _sdpa_reference(query, kv_cache, block_tables, lens, rows, scale, window)
    n = len(seq_lens)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual[:n].float(), expected, **QUANT_TOLERANCES[dtype])
    assert (actual[n:] == 7.0).all()


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_matches_dequantized_sdpa(march, codec, dtype):
    """Each codec x query dtype on each path: W1's GQA shape (9 heads on 3; 9 decodes:
    a task per request, the others are split by KV head), a group of 5
    (two weight groups) at head_dim 96 (a 64- and a 32-column group), head_dim 80 (the
    portable loops even on AVX-512), a sliding window mid-tile; ragged lengths on
    shuffled blocks."""
    kern = _kernel_for(march)
    lens = [1, 15, 16, 17, 33, 70]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 9 decodes >= 4 per thread: one task per request
    try:
        _check_quantized(kern, codec, dtype, 9, 3, 64, 16, [*lens, 3, 48, 21])
    finally:
        torch.set_num_threads(threads)
    _check_quantized(kern, codec, dtype, 10, 2, 96, 5, lens, window=20)
    _check_quantized(kern, codec, dtype, 4, 2, 80, 8, lens[:4], window=7)


@pytest.mark.parametrize("codec", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_subnormal_codes_survive_flush_to_zero(codec):
    """Rows whose small elements get subnormal fp8 codes (their float16 images are
    subnormal too): the result is the same with the CPU's denormals-are-zero mode on."""
    gen = torch.Generator().manual_seed(3)
    query, raw, block_tables, lens = _random_case(4, 2, 64, 16, [40, 9], torch.float32, gen)
    raw = raw * 1e-4
    raw[..., 0] = 50.0  # the row's max: everything else lands on the smallest codes
    kv_cache = kv_codec.quantize_rows(raw, codec)
    subnormal = kv_cache.view(torch.uint8)[..., :64] & 0x7F
    assert ((subnormal > 0) & (subnormal < (8 if codec == torch.float8_e4m3fn else 4))).any()
    rows = torch.arange(2, dtype=torch.int32)
    expected = _sdpa_reference(query, kv_cache, block_tables, lens, rows, 1.0, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the flag is per thread: run on this one
    try:
        assert torch.set_flush_denormal(True)
        actual = torch.zeros_like(query)
        kernel(query, kv_cache, block_tables, lens, rows, rows, actual, 1.0)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    torch.testing.assert_close(actual[:2], expected, **QUANT_TOLERANCES[torch.float32])


def test_quantized_supports_and_shape_checks():
    query = torch.zeros(2, 4, 64)
    cache = torch.zeros(2, 4, 16, 2, 68, dtype=torch.int8)
    assert kernel.supports(query, cache) and kernel.supports(query.bfloat16(), cache)
    assert not kernel.supports(query.half(), cache)
    assert not kernel.supports(query, cache.view(torch.uint8))  # no codec of that dtype
    rows = torch.zeros(1, dtype=torch.int32)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="heads of 64"):  # a row of head_dim + 4 expected
        kernel(query, cache[..., :64], tables, lens, rows, rows, torch.zeros_like(query), 1.0)


def test_int8_cache_bf16_query_error_budget():
    """bf16 queries over an int8 cache: with AVX512_VNNI the kernel scores an int8 query
    (q * scale rounded per head to 127 / its largest element, paged_decode_quant_avx512.h)
    against the codes. (1) It computes exactly that: against the reference fed the rounded
    query, the difference is the bf16 rounding of the output (mean within 1.5x of it).
    (2) The rounding costs less than the int8 cache itself: against attention over the
    float cache, its error stays within 1.3x that of the exact attention over the
    dequantized cache (measured 1.16x; the query rounding alone is 0.66x the cache's)."""
    gen = torch.Generator().manual_seed(5)
    lens = [300, 290, 64, 7, 33, 128]
    query, raw, block_tables, seq_lens = _random_case(9, 3, 64, 16, lens, torch.float32, gen)
    kv_cache = kv_codec.quantize_rows(raw, torch.int8)
    query, n, scale = query.bfloat16(), len(lens), 64**-0.5
    rows = torch.arange(n, dtype=torch.int32)
    args = (block_tables, seq_lens, rows, rows)

    def reference(q: torch.Tensor, cache: torch.Tensor, q_scale: float) -> torch.Tensor:
        out = torch.zeros(q.shape)
        paged_decode_attention_ref(q.float(), cache, *args, out, q_scale)
        return out[:n]

    actual = torch.zeros_like(query)
    kernel(query, kv_cache, *args, actual, scale)
    actual = actual[:n].float()
    exact = reference(query, kv_cache, scale)
    if "avx512_vnni" in cpu_flags():
        scaled = query.float() * scale
        amax = scaled.abs().amax(-1, keepdim=True)
        rounded = (scaled * 127 / amax).round() * amax / 127
        modeled = reference(rounded, kv_cache, 1.0)
        bf16_rounding = (modeled.bfloat16().float() - modeled).abs().mean()
        assert (actual - modeled).abs().mean() < 1.5 * bf16_rounding
        torch.testing.assert_close(actual, modeled, **TOLERANCES[torch.bfloat16])
    float_cache = reference(query, raw, scale)
    cache_error = (exact - float_cache).abs().mean()
    assert (actual - float_cache).abs().mean() < 1.3 * cache_error

"""Paged attention kernels (unified and split-KV) against the torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton.language as tl

from kvflow.kernels import kv_codec
from kvflow.kernels import paged_attention as paged_attention_module
from kvflow.kernels.paged_attention import (
    SplitKVScratch,
    choose_num_splits,
    choose_tile_n,
    paged_attention,
    paged_attention_ref,
    split_kv_paged_attention,
    unified_paged_attention,
)

F32, BF16 = torch.float32, torch.bfloat16
E5M2 = torch.float8_e5m2

# (seq_len, q_len): a decode, a fresh prefill spanning several query tiles, a chunk over a
# 2-token prefix, a chunk over a 33-token cached prefix, a decode on a partial block.
MIXED = [(21, 1), (37, 37), (5, 3), (50, 17), (9, 1)]
DECODES = [(70, 1), (33, 1), (5, 1), (100, 1)]
# Smaller mixed batch for the window tests: windows cut into a prefix and into a chunk.
WINDOWED = [(21, 1), (30, 12), (9, 2)]


def _run_ref(batch, scale, window=None):
    return paged_attention_ref(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale, window,
    )  # fmt: skip


def _inputs(batch):
    return (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype", "tile_n"),
    [
        (2, 2, 64, 16, F32, 32),  # MHA
        (4, 2, 80, 16, BF16, 16),  # GQA 2, head dim 80
        (8, 2, 96, 8, F32, 16),  # GQA 4, head dim 96, block size 8
        (8, 1, 128, 32, BF16, 32),  # GQA 8 on one KV head (MQA), head dim 128
        (4, 1, 40, 16, F32, 16),  # MQA, head dim 40 (padded to 64)
        (6, 2, 48, 24, BF16, 32),  # group of 3 (not a power of two), block size 24
        (9, 3, 64, 16, BF16, 64),  # SmolLM2's heads, the decode tile
    ],
)
def test_unified_mixed_batch(
    make_batch, assert_close, num_heads, num_kv_heads, head_dim, block_size, dtype, tile_n
):
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype, 3)
    scale = head_dim**-0.5
    out = unified_paged_attention(
        *_inputs(batch), scale, max_query_len=batch.max_query_len, tile_n=tile_n
    )
    expected = _run_ref(batch, scale)
    assert_close(out, expected)
    assert torch.equal(out[batch.num_actual_tokens :], torch.zeros_like(out[-3:]))


def test_unified_long_prefill_several_tiles_per_request(make_batch, assert_close):
    # Group 1 gives 64-row tiles: a 70-token chunk over a 30-token prefix needs two.
    batch = make_batch([(100, 70), (3, 3)], 2, 2, 64, 16, F32)
    out = unified_paged_attention(*_inputs(batch), 0.125, max_query_len=70, tile_n=32)
    assert_close(out, _run_ref(batch, 0.125))


def test_strided_query_view(make_batch, assert_close):
    # The model hands attention a view of its fused qkv projection: rows are strided.
    batch = make_batch([(12, 5), (4, 1)], 4, 2, 64, 16, F32)
    fused = torch.randn(batch.query.shape[0], 4 + 2 + 2, 64, device=batch.query.device)
    fused[:, :4] = batch.query
    query = fused[:, :4]
    out = unified_paged_attention(query, *_inputs(batch)[1:], 0.125, max_query_len=5)
    assert_close(out, _run_ref(batch, 0.125))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype", "window"),
    [(4, 2, 64, 16, F32, 8), (8, 1, 40, 8, BF16, 13)],
)
def test_sliding_window(
    make_batch, assert_close, num_heads, num_kv_heads, head_dim, block_size, dtype, window, split
):
    batch = make_batch(WINDOWED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    kwargs = {"max_query_len": batch.max_query_len, "tile_n": 16}
    if split:
        out = split_kv_paged_attention(*_inputs(batch), 0.1, window, num_splits=3, **kwargs)
    else:
        out = unified_paged_attention(*_inputs(batch), 0.1, window, **kwargs)
    assert_close(out, _run_ref(batch, 0.1, window))


@pytest.mark.parametrize(
    ("requests", "num_heads", "num_kv_heads", "head_dim", "dtype", "num_splits"),
    [
        (DECODES, 2, 2, 64, F32, 2),
        (DECODES, 8, 2, 80, BF16, 4),
        (DECODES, 8, 1, 128, F32, 7),  # more splits than key tiles: some are empty
        (MIXED, 4, 2, 96, BF16, 3),  # split-KV also serves multi-token queries
    ],
)
def test_split_kv(
    make_batch, assert_close, requests, num_heads, num_kv_heads, head_dim, dtype, num_splits
):
    batch = make_batch(requests, num_heads, num_kv_heads, head_dim, 16, dtype, 2)
    out = split_kv_paged_attention(
        *_inputs(batch), 0.2, max_query_len=batch.max_query_len, num_splits=num_splits,
        tile_n=16,
    )  # fmt: skip
    assert_close(out, _run_ref(batch, 0.2))
    assert torch.equal(out[batch.num_actual_tokens :], torch.zeros_like(out[-2:]))


def test_dispatch_with_preallocated_scratch_and_out(make_batch, assert_close, device):
    # A scratch sized for a larger batch and more splits is used through its prefix,
    # and `out` is written in place, as a captured CUDA graph would need.
    batch = make_batch(DECODES, 4, 2, 64, 16, F32)
    scratch = SplitKVScratch.allocate(16, 4, 64, 8, device)
    scratch.acc.fill_(float("nan"))
    out = torch.empty_like(batch.query)
    result = paged_attention(
        *_inputs(batch), 0.125, max_query_len=1, max_seq_len=batch.max_seq_len,
        num_splits=5, scratch=scratch, out=out,
    )  # fmt: skip
    assert result is out
    assert_close(out, _run_ref(batch, 0.125))


def test_dispatch_chooses_unified_on_cpu_and_matches(make_batch, assert_close, device):
    batch = make_batch(MIXED, 4, 2, 64, 16, F32)
    out = paged_attention(
        *_inputs(batch), 0.125, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len
    )
    assert_close(out, _run_ref(batch, 0.125))


@pytest.mark.parametrize(
    ("num_reqs", "num_kv_heads", "max_query_len", "max_seq_len", "expected"),
    [
        (4, 8, 1, 4096, 9),  # 32 programs on 132 SMs: ceil(264 / 32) splits
        (1, 1, 1, 100_000, 16),  # capped at 16 splits
        (2, 8, 1, 700, 2),  # 700 keys allow only 2 splits of >= 256 keys
        (4, 8, 1, 300, 1),  # too short to split
        (64, 8, 1, 2048, 1),  # 512 programs already fill the GPU
        (4, 8, 2, 4096, 1),  # not a decode batch
    ],
)
def test_choose_num_splits(num_reqs, num_kv_heads, max_query_len, max_seq_len, expected):
    assert choose_num_splits(num_reqs, num_kv_heads, max_query_len, max_seq_len, 132) == expected


def test_decode_batches_take_the_wide_tile() -> None:
    assert [choose_tile_n(q) for q in (1, 2, 512)] == [64, 32, 32]


@pytest.mark.parametrize("codec", list(kv_codec.CODEC_DTYPES))
@pytest.mark.parametrize(
    ("requests", "num_heads", "num_kv_heads", "head_dim", "dtype", "num_splits", "window"),
    [
        (MIXED, 8, 2, 64, BF16, 1, None),  # decodes, a fresh prefill, chunks over prefixes
        (DECODES, 4, 1, 80, F32, 4, None),  # split-KV decodes on one KV head, head dim 80
        (WINDOWED, 6, 2, 48, F32, 2, 8),  # window, split-KV over chunks, group of 3
    ],
)
def test_quantized_cache_matches_dequantized_reference(
    make_batch, quantize_batch, assert_close, codec, requests, num_heads, num_kv_heads, head_dim, dtype,
    num_splits, window,
):  # fmt: skip
    batch = make_batch(requests, num_heads, num_kv_heads, head_dim, 16, dtype, 2)
    batch = quantize_batch(batch, kv_codec.CODEC_DTYPES[codec])
    out = paged_attention(
        *_inputs(batch), 0.15, window, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, num_splits=num_splits,
    )  # fmt: skip
    # The reference reads the dequantized values (dequantize_rows, then masked softmax).
    dequantized = kv_codec.dequantize_rows(batch.kv_cache)
    expected = paged_attention_ref(batch.query, dequantized, *_inputs(batch)[2:], 0.15, window)
    assert_close(out, expected)
    assert torch.equal(out[batch.num_actual_tokens :], torch.zeros_like(out[-2:]))
    assert torch.equal(_run_ref(batch, 0.15, window), expected)


@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (3, 9)])
def test_quantized_cache_fresh_prefills_attend_fresh_rows(
    make_batch, quantize_batch, assert_close, num_splits, window
):
    # A request with no cached prefix (37, 37) attends this step's K/V as computed; the
    # others read the cache. The fresh rows differ from the cached ones here, so a kernel
    # that reads the wrong source for any request fails.
    batch = make_batch(MIXED, 4, 2, 64, 16, BF16, 2)
    batch = quantize_batch(batch, torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(batch.query.shape[0], 3 * 2, 64, generator=gen).to(BF16)
    fused = fused.to(batch.query.device)
    fresh = (fused[:, :2], fused[:, 2:4])  # strided views, as the model's qkv gives them
    out = paged_attention(
        *_inputs(batch), 0.15, window, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, num_splits=num_splits, fresh_kv=fresh,
    )  # fmt: skip
    dequantized = kv_codec.dequantize_rows(batch.kv_cache)
    args = (batch.query, dequantized, *_inputs(batch)[2:], 0.15, window)
    expected = paged_attention_ref(*args, fresh_kv=fresh)
    assert_close(out, expected)
    # The fresh prefill's rows (1..37) changed; every other request's did not.
    changed = (expected != paged_attention_ref(*args)).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == list(range(1, 38))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fresh_key_and_value_with_different_row_strides(
    make_batch, quantize_batch, step_kv, assert_close, kv_layout, num_splits
):
    # A Llama layer's K is a view of the fused qkv output (row stride (H + 2 KH) D) while
    # its V may be a contiguous copy, or the reverse (Qwen3's normed K): the kernel reads
    # each with its own strides.
    batch = quantize_batch(make_batch(MIXED, 4, 2, 64, 16, BF16, 2), torch.int8)
    fresh = step_kv(batch.query.shape[0], 4, 2, 64, BF16, kv_layout)
    out = paged_attention(
        *_inputs(batch), 0.15, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, num_splits=num_splits, fresh_kv=fresh,
    )  # fmt: skip
    dequantized = kv_codec.dequantize_rows(batch.kv_cache)
    args = (batch.query, dequantized, *_inputs(batch)[2:], 0.15)
    assert_close(out, paged_attention_ref(*args, fresh_kv=fresh))
    # The same rows as contiguous copies: the same result, the layout is not the data.
    copies = tuple(x.contiguous() for x in fresh)
    assert_close(out, paged_attention_ref(*args, fresh_kv=copies))


def test_quantized_cache_with_fp16_dot_operands(make_batch, quantize_batch, monkeypatch):
    # fp16 operands (an fp16 model on a GPU; forced here under the interpreter, which picks
    # fp32) with small values in e5m2: s_v = amax / 57344, so weights p * s_v would fall
    # below fp16's normal range; the kernel must keep ~fp16 precision (folding s_v into p
    # gives ~37% error on this batch).
    def fp16_dots(kernel, dtype):
        return tl.float16 if dtype == torch.float16 else tl.float32

    monkeypatch.setattr(paged_attention_module, "dot_dtype", fp16_dots)
    batch = make_batch([(21, 1), (50, 17)], 4, 2, 64, 16, torch.float16)
    batch = quantize_batch(dataclasses.replace(batch, kv_cache=batch.kv_cache * 1e-3), E5M2)
    out = unified_paged_attention(*_inputs(batch), 0.125, max_query_len=17)
    dequantized = kv_codec.dequantize_rows(batch.kv_cache)
    expected = paged_attention_ref(batch.query.float(), dequantized, *_inputs(batch)[2:], 0.125)
    assert (out.float() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_quantized_cache_rejects_a_mismatched_head_dim(make_batch, quantize_batch):
    batch = quantize_batch(make_batch([(5, 1)], 2, 2, 64, 16, F32), torch.int8)
    with pytest.raises(AssertionError):  # rows of head_dim 64 + 4 bytes, queries of 68
        unified_paged_attention(
            torch.zeros(1, 2, 68, device=batch.query.device), *_inputs(batch)[1:], 0.1,
            max_query_len=1,
        )  # fmt: skip


def test_reference_matches_dense_causal_attention():
    # The reference itself: a 4-token chunk over a 3-token prefix equals SDPA with the
    # bottom-right-aligned causal mask.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 7, 32, generator=gen) for n in (4, 7, 7))
    kv_cache = torch.stack([k, v])[:, None]  # [2, 1 block, 7 slots, 7 kv heads, 32]
    out = paged_attention_ref(
        q, kv_cache, torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 0.3,
    )  # fmt: skip
    mask = torch.ones(4, 7, dtype=torch.bool).tril(diagonal=3)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)

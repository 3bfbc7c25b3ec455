"""TritonAttentionBackend against the torch backend on the same steps, and over quantized
caches against the kernel references."""

from __future__ import annotations

import pytest
import torch

from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attention.triton_backend import TritonAttentionBackend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels import kv_codec
from kvflow.kernels.paged_attention import paged_attention_ref
from kvflow.kernels.store_kv import store_kv_ref


def _metadata(batch) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        query_start_loc_cpu=batch.query_start_loc.tolist(),
        seq_lens_cpu=batch.seq_lens.tolist(),
        logits_indices=batch.query_start_loc[1:].long() - 1,
    )


def _step(make_batch, requests, num_pad_tokens=0, dtype=torch.float32):
    """A step whose new K/V are not in the cache yet: the backend must store them."""
    batch = make_batch(requests, 4, 2, 64, 16, dtype, num_pad_tokens)
    gen = torch.Generator().manual_seed(7)
    shape = (batch.query.shape[0], 2, 64)
    key = torch.randn(shape, generator=gen).to(dtype).to(batch.query.device)
    value = torch.randn(shape, generator=gen).to(dtype).to(batch.query.device)
    return batch, key, value


@pytest.mark.parametrize(("num_splits", "window"), [(None, None), (3, None), (None, 6)])
def test_forward_matches_torch_backend(make_batch, assert_close, num_splits, window):
    batch, key, value = _step(make_batch, [(21, 1), (37, 37), (50, 17), (9, 1)], 2)
    metadata = _metadata(batch)
    torch_cache, triton_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = TorchAttentionBackend().forward(
        batch.query, key, value, torch_cache, metadata, 0.125, window
    )
    out = TritonAttentionBackend(num_splits).forward(
        batch.query, key, value, triton_cache, metadata, 0.125, window
    )
    assert_close(out, expected)
    # Both stored exactly the same slots (untouched slots stay NaN in both).
    torch.testing.assert_close(triton_cache, torch_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("codec", [None, "int8"])
def test_forward_takes_projection_views(make_batch, quantize_batch, step_kv, kv_layout, codec):
    # What an attention layer passes (issue #30: a Llama layer's K view of the qkv output
    # beside a contiguous V failed the launcher's checks): the same output and cache as
    # contiguous copies of the same rows give.
    batch = make_batch([(21, 1), (37, 37), (50, 17)], 4, 2, 64, 16, torch.bfloat16, 2)
    if codec is not None:
        batch = quantize_batch(batch, kv_codec.CODEC_DTYPES[codec])
    key, value = step_kv(batch.query.shape[0], 4, 2, 64, torch.bfloat16, kv_layout)
    metadata = _metadata(batch)
    copies_cache, views_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = TritonAttentionBackend().forward(
        batch.query, key.contiguous(), value.contiguous(), copies_cache, metadata, 0.125
    )
    out = TritonAttentionBackend().forward(batch.query, key, value, views_cache, metadata, 0.125)
    assert torch.equal(out, expected)
    assert torch.equal(views_cache.view(torch.uint8), copies_cache.view(torch.uint8))


def test_split_scratch_grows_and_is_reused(make_batch, assert_close):
    backend = TritonAttentionBackend(num_splits=2)
    for requests in ([(40, 1), (20, 1)], [(40, 1), (20, 1), (33, 1)], [(5, 1)]):
        batch, key, value = _step(make_batch, requests)
        metadata = _metadata(batch)
        expected_cache = batch.kv_cache.clone()
        expected = TorchAttentionBackend().forward(
            batch.query, key, value, expected_cache, metadata, 0.125
        )
        out = backend.forward(batch.query, key, value, batch.kv_cache, metadata, 0.125)
        assert_close(out, expected)
    assert backend._scratch is not None and backend._scratch.acc.shape[:3] == (3, 4, 2)


def test_empty_cache_profiling_pass_falls_back(make_batch, assert_close, device):
    batch, key, value = _step(make_batch, [(6, 6), (3, 3)])
    metadata = _metadata(batch)
    empty = torch.empty(0, device=device)
    expected = TorchAttentionBackend().forward(batch.query, key, value, empty, metadata, 0.125)
    out = TritonAttentionBackend().forward(batch.query, key, value, empty, metadata, 0.125)
    assert_close(out, expected)


def _quantized_step(make_batch, quantize_batch, codec, requests, num_pad_tokens=2):
    batch, key, value = _step(make_batch, requests, num_pad_tokens, dtype=torch.bfloat16)
    return quantize_batch(batch, kv_codec.CODEC_DTYPES[codec]), key, value


def _expected_over(batch, key, value, cache, scale, window):
    """The reference over the cache as the backend left it, dequantized, with requests that
    have no cached prefix attending the step's own K/V."""
    return paged_attention_ref(
        batch.query, kv_codec.dequantize_rows(cache), batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale, window, fresh_kv=(key, value),
    )  # fmt: skip


@pytest.mark.slow  # ~4 s each, interpreted
@pytest.mark.parametrize(
    ("codec", "num_splits", "window"),
    [("int8", None, None), ("fp8_e4m3", 3, 6), ("fp8_e5m2", None, 6)],
)
def test_forward_over_quantized_cache(
    make_batch, quantize_batch, assert_close, codec, num_splits, window
):
    # A decode and a chunk over a cached prefix read the cache after this step's rows were
    # stored, quantized; the fresh prefill attends its K/V as computed.
    batch, key, value = _quantized_step(
        make_batch, quantize_batch, codec, [(21, 1), (37, 37), (50, 17), (9, 1)]
    )
    expected_cache = batch.kv_cache.cpu().clone()  # the CPU reference is exact (test_store_kv)
    store_kv_ref(key.cpu(), value.cpu(), expected_cache, batch.slot_mapping.cpu())
    cache = batch.kv_cache
    out = TritonAttentionBackend(num_splits).forward(
        batch.query, key, value, cache, _metadata(batch), 0.125, window
    )
    assert_close(out, _expected_over(batch, key, value, cache, 0.125, window))
    assert torch.equal(cache.cpu().view(torch.uint8), expected_cache.view(torch.uint8))


@pytest.mark.cuda  # CUDA graphs
@pytest.mark.parametrize("codec", list(kv_codec.CODEC_DTYPES))
def test_quantized_decode_step_replays_in_a_cuda_graph(make_batch, quantize_batch, codec):
    # Store + split-KV attention over a quantized cache, captured once and replayed on a
    # fresh copy of the cache: the replay writes the same bytes and gives the eager output.
    batch, key, value = _quantized_step(
        make_batch, quantize_batch, codec, [(300, 1), (40, 1), (129, 1)]
    )
    metadata = _metadata(batch)
    backend = TritonAttentionBackend(num_splits=4)
    backend.reserve_scratch(8, 4, 64, 4, batch.query.device)
    eager_cache = batch.kv_cache.clone()
    eager = backend.forward(batch.query, key, value, eager_cache, metadata, 0.125)
    graph_cache = batch.kv_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(batch.query, key, value, graph_cache, metadata, 0.125)
    graph_cache.copy_(batch.kv_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(graph_cache.view(torch.uint8), eager_cache.view(torch.uint8))

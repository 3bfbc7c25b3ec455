"""TritonAttentionBackend against the torch backend on the same steps."""

from __future__ import annotations

import pytest
import torch

from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attention.triton_backend import TritonAttentionBackend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata


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

"""Sliding-window attention reads only the blocks inside the window, on every backend:
the hybrid KV cache releases the blocks before it (table entry -1, or a block another
request now owns). Here the entries before the window point at a block of NaNs, which
any read (even one masked afterwards) would spread into the output."""

from __future__ import annotations

import pytest
import torch

from kvflow.gpu_worker.attention.backend import AttentionBackend, get_attention_backend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata

B, KV_HEADS, HEADS, DIM, WINDOW = 4, 2, 4, 16, 6
NAN_BLOCK = 7


def _step(q_len: int, seq_len: int, tables: list[int]) -> AttentionMetadata:
    positions = torch.arange(seq_len - q_len, seq_len)
    table = torch.tensor(tables, dtype=torch.int32)
    slots = table[positions // B].long() * B + positions % B
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=table[None, :],
        max_query_len=q_len,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, q_len],
        seq_lens_cpu=[seq_len],
        logits_indices=torch.tensor([q_len - 1]),
    )


def _backend(name: str) -> AttentionBackend:
    if name == "triton-split-kv":  # flash-decoding: each split starts inside the window
        from kvflow.gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_splits=3)
    return get_attention_backend(name)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton", "triton-split-kv"])
@pytest.mark.parametrize("q_len", [1, 3])  # a decode; a chunk over a cached prefix
def test_blocks_before_the_window_are_never_read(backend: str, q_len: int) -> None:
    seq_len = 22  # the first query sits at 22 - q_len and reads keys from there - 5 on
    first_needed = max(0, seq_len - q_len - WINDOW + 1) // B
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 8, B, KV_HEADS, DIM, generator=gen)
    real = [0, 1, 2, 3, 4, 5]  # the blocks as the request first held them
    released = [NAN_BLOCK] * first_needed + real[first_needed:]
    cache[:, NAN_BLOCK] = float("nan")
    query = torch.randn(q_len, HEADS, DIM, generator=gen)
    key = torch.randn(q_len, KV_HEADS, DIM, generator=gen)
    value = torch.randn(q_len, KV_HEADS, DIM, generator=gen)
    expected = get_attention_backend("torch").forward(
        query, key, value, cache.clone(), _step(q_len, seq_len, real), 0.25, WINDOW
    )
    out = _backend(backend).forward(
        query, key, value, cache.clone(), _step(q_len, seq_len, released), 0.25, WINDOW
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)

"""A step of short queries over cached contexts (a speculative verification step) run as
one-token decodes (gpu_worker/token_decodes.py) attends exactly what the step itself
attends: the torch backend's prefill path over the original step is the reference, the
expanded step runs the decode path (native kernel, or torch ops), with and without a
sliding window, over two KV groups' tables."""

from __future__ import annotations

import pytest
import torch

from kvflow.gpu_worker.attention.backend import get_attention_backend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.gpu_worker.token_decodes import as_token_decodes

B, KV_HEADS, HEADS, DIM = 4, 2, 4, 16
# (query tokens, context incl. them, block table) per request: a verification of
# 1 + 3 drafts, one of 1 + 1, a plain decode, one of 1 + 4 crossing a block
REQUESTS = [(4, 11, [5, 2, 7]), (2, 6, [0, 3]), (1, 9, [1, 4, 6]), (5, 8, [8, 9])]


def _step() -> AttentionMetadata:
    slots, starts = [], [0]
    for q_len, seq_len, table in REQUESTS:
        slots += [table[p // B] * B + p % B for p in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    width = max(len(t) for _, _, t in REQUESTS)
    tables = [t + [0] * (width - len(t)) for _, _, t in REQUESTS]
    lens = [seq_len for _, seq_len, _ in REQUESTS]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(q for q, _, _ in REQUESTS),
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        logits_indices=torch.arange(starts[-1]),
    )
    return md


def test_rows_lengths_and_tables() -> None:
    md = _step()
    md.group_metadata.append(
        AttentionMetadata(**{**md.__dict__, "block_tables": md.block_tables + 10})
    )
    rows = as_token_decodes(md)
    assert rows.is_decode_only and rows.num_reqs == 12
    assert rows.seq_lens_cpu == [8, 9, 10, 11, 5, 6, 9, 4, 5, 6, 7, 8]
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu
    assert rows.query_start_loc.tolist() == list(range(13))
    owners = [0] * 4 + [1] * 2 + [2] + [3] * 5
    assert torch.equal(rows.block_tables, md.block_tables[owners])
    assert torch.equal(rows.group_metadata[0].block_tables, md.block_tables[owners] + 10)
    assert rows.slot_mapping is md.slot_mapping  # the same rows store the same K/V


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_decodes_attend_what_the_step_attends(
    backend: str, window: int | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 10, B, KV_HEADS, DIM, generator=gen).to(dtype)
    md = _step()
    num_tokens = md.query_start_loc_cpu[-1]
    query, key, value = (
        torch.randn(num_tokens, heads, DIM, generator=gen).to(dtype)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    reference_cache = cache.clone()
    expected = get_attention_backend("torch").forward(
        query, key, value, reference_cache, md, 0.25, window
    )
    out = get_attention_backend(backend).forward(
        query, key, value, cache, as_token_decodes(md), 0.25, window
    )
    assert torch.equal(cache, reference_cache)  # the same K/V stored in the same slots
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)

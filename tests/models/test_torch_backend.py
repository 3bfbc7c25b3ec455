"""TorchAttentionBackend against a dense per-request reference that never sees pages.

Each request has a full K/V history; its prefix is written into randomly placed blocks
beforehand, the step's tail comes in as key/value. The cache starts as NaN so any read
of an unwritten slot (or a write to a padding slot's -1) shows up in the result.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.gpu_worker.attention.backend import get_attention_backend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels.cpu import elementwise


def _reference(q, k, v, scale, window):  # q [Lq, H, D], k/v [L, KH, D] -> [Lq, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - (window or k.shape[0] + 1))
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, num_padding, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), math.nan, dtype=dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    histories, slots = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        blocks = [order.pop() for _ in range(-(-seq_len // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        pos_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k, v = (torch.randn(seq_len, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
        for p in range(seq_len - q_len):  # the cached prefix
            cache[0].view(-1, kv_heads, head_dim)[pos_slots[p]] = k[p]
            cache[1].view(-1, kv_heads, head_dim)[pos_slots[p]] = v[p]
        histories.append((k, v))
        slots += pos_slots[seq_len - q_len :]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * num_padding),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
    )
    return cache, histories, metadata


CASES = {
    # q_lens, seq_lens, heads, kv_heads, head_dim, block_size, padding, window
    "decodes-gqa4": ([1, 1, 1, 1], [1, 7, 16, 33], 8, 2, 16, 4, 0, None),
    "mixed-hd13": ([1, 6, 1, 5, 3], [9, 6, 30, 12, 3], 4, 4, 13, 4, 3, None),
    "mixed-window": ([4, 1, 1, 9], [20, 18, 3, 9], 6, 2, 32, 8, 2, 5),
    "chunk-mqa": ([7, 1], [25, 40], 4, 1, 24, 16, 0, 11),
}


@pytest.mark.parametrize("native_store", [True, False], ids=["native-store", "index-copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_dense_reference(
    name: str, dtype: torch.dtype, native_store: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both stores of the step's K/V (the native one on CPUs, index_copy_ elsewhere)."""
    if not native_store:
        monkeypatch.setattr(elementwise, "store_applies", lambda *_: False)
    elif elementwise._library() is None:
        pytest.skip("native CPU kernels unavailable")
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size, padding, window = CASES[name]
    cache, histories, md = _case(
        q_lens, seq_lens, heads, kv_heads, head_dim, block_size, padding, dtype, seed=len(name)
    )
    g = torch.Generator().manual_seed(7)
    num_tokens = sum(q_lens) + padding
    query = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    tails = [(k[s - q :], v[s - q :]) for (k, v), q, s in zip(histories, q_lens, seq_lens)]
    pad = torch.zeros(padding, kv_heads, head_dim, dtype=dtype)
    key = torch.cat([k for k, _ in tails] + [pad])
    value = torch.cat([v for _, v in tails] + [pad])
    backend = get_attention_backend("torch")
    scale = head_dim**-0.5
    out = backend.forward(query, key, value, cache, md, scale, window)
    assert out.shape == query.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    starts = md.query_start_loc_cpu
    for i, (k, v) in enumerate(histories):
        rows = slice(starts[i], starts[i + 1])
        expected = _reference(query[rows], k, v, scale, window)
        torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)
    assert torch.equal(out[starts[-1] :], torch.zeros(padding, heads, head_dim, dtype=dtype))
    written = sum(-(-s // block_size) * block_size for s in seq_lens) - sum(seq_lens)
    assert int(cache[0].isnan().any(-1).any(-1).sum()) == written + 2 * block_size


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        get_attention_backend("cuda")

"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator,
with no value) on every path that runs them: the paged reference against an independent
identity, the Triton kernels (unified and split-KV, interpreted on CPU) against the
reference, and the torch, cpu and triton backends against each other on one step.

The identity: with Z = sum_i exp(s_i) and the plain softmax output o, adding the sink
gives o * Z / (Z + exp(sink)) = o * sigmoid(logsumexp(s) - sink), per query row.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_backend import _metadata, _step

from kvflow.gpu_worker.attention.backend import get_attention_backend
from kvflow.gpu_worker.attention.softcap import attend
from kvflow.kernels.paged_attention import (
    paged_attention_ref,
    split_kv_paged_attention,
    unified_paged_attention,
)

F32, BF16 = torch.float32, torch.bfloat16
# A decode, a fresh prefill over several tiles, a chunk over a cached prefix, a decode on
# a partial block: every kind of request of a step.
MIXED = [(21, 1), (37, 37), (50, 17), (9, 1)]


def _sinks(num_heads: int, device: str, seed: int = 11) -> torch.Tensor:
    """Sinks on the scale of the logits, some large enough to take most of the weight."""
    gen = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(num_heads, generator=gen)).to(device)


def _inputs(batch):
    return (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)


def test_attend_with_sinks_scales_the_plain_softmax_by_the_identity() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=gen, dtype=torch.float64) for _ in "qkv")
    sinks = torch.tensor([-1.0, 0.0, 2.0, 30.0], dtype=torch.float64)
    plain = attend(q, k, v, None, is_causal=True, scale=0.25)
    got = attend(q, k, v, None, is_causal=True, scale=0.25, sinks=sinks.view(4, 1, 1))
    scores = (q @ k.transpose(-1, -2) * 0.25).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), -torch.inf
    )
    share = torch.sigmoid(scores.logsumexp(-1, keepdim=True) - sinks.view(4, 1, 1))
    torch.testing.assert_close(got, plain * share)
    assert got[0, 3].abs().max() < 1e-9  # a sink of 30 takes (almost) all the weight


def test_reference_matches_the_identity(make_batch) -> None:
    batch = make_batch(MIXED, 4, 2, 32, 16, F32)
    sinks = _sinks(4, batch.query.device.type)
    got = paged_attention_ref(*_inputs(batch), 0.2, 6, sinks=sinks)
    plain = paged_attention_ref(*_inputs(batch), 0.2, 6)
    # Per token and head: logsumexp of its visible scores, recomputed densely.
    dev = batch.query.device
    lse = torch.empty(batch.query.shape[:2], device=dev)
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len, device=dev)
        blocks = batch.block_tables[r, pos // 16].long()
        k = batch.kv_cache[0, blocks, pos % 16].repeat_interleave(2, dim=1)  # [L, H, D]
        q = batch.query[starts[r] : starts[r + 1]]
        q_pos = seq_len - q.shape[0] + torch.arange(q.shape[0], device=dev)
        delta = q_pos[:, None] - pos[None, :]
        scores = torch.einsum("qhd,khd->qhk", q, k) * 0.2
        scores = scores.masked_fill(~((delta >= 0) & (delta < 6))[:, None, :], -torch.inf)
        lse[starts[r] : starts[r + 1]] = scores.logsumexp(-1)
    expected = plain * torch.sigmoid(lse - sinks)[..., None]
    n = batch.num_actual_tokens
    torch.testing.assert_close(got[:n], expected[:n], atol=1e-5, rtol=1e-5)
    assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "window", "num_splits"),
    [
        (4, 2, 64, F32, None, 1),  # GQA 2
        (6, 2, 48, BF16, 7, 1),  # group of 3, a window, bf16
        (4, 1, 40, F32, None, 3),  # split-KV: only split 0 starts from the sink
        (8, 2, 80, BF16, 9, 5),  # split-KV with a window, some splits empty
    ],
)
def test_kernels_match_reference(
    make_batch, assert_close, num_heads, num_kv_heads, head_dim, dtype, window, num_splits
):
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, 16, dtype, 2)
    sinks = _sinks(num_heads, batch.query.device.type).to(dtype)
    kwargs = dict(max_query_len=batch.max_query_len, tile_n=16, sinks=sinks)
    if num_splits == 1:
        out = unified_paged_attention(*_inputs(batch), 0.15, window, **kwargs)
    else:
        out = split_kv_paged_attention(
            *_inputs(batch), 0.15, window, num_splits=num_splits, **kwargs
        )
    assert_close(out, paged_attention_ref(*_inputs(batch), 0.15, window, sinks=sinks))
    assert torch.equal(out[batch.num_actual_tokens :], torch.zeros_like(out[-2:]))


@pytest.mark.parametrize("window", [None, 6])
def test_backends_agree_on_a_step_with_sinks(make_batch, assert_close, window) -> None:
    """torch (reference), cpu (whose native kernels have no sinks: the torch path serves
    sink layers) and triton, each storing the step's K/V into its own cache copy."""
    batch, key, value = _step(make_batch, MIXED, num_pad_tokens=2)
    sinks = _sinks(4, batch.query.device.type)
    metadata = _metadata(batch)
    outs = {}
    for name in ("torch", "cpu", "triton"):
        if name == "cpu" and batch.query.is_cuda:
            continue
        cache = batch.kv_cache.clone()
        outs[name] = get_attention_backend(name).forward(
            batch.query, key, value, cache, metadata, 0.125, window, sinks=sinks
        )
    plain = get_attention_backend("torch").forward(
        batch.query, key, value, batch.kv_cache.clone(), metadata, 0.125, window
    )
    for out in outs.values():
        assert_close(out, outs["torch"])
    assert (outs["torch"] - plain).abs().max() > 1e-2  # the sinks changed the result

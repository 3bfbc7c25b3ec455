"""Rotary embedding (neox and interleaved layouts, full and partial) against its reference."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.rotary import (
    rope_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
    rotary_embedding_tables,
)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    ("head_dim", "rot_dim", "dtype"),
    [(64, 64, torch.float32), (40, 40, torch.bfloat16), (64, 32, torch.bfloat16)],
)
def test_rotary_matches_reference(device, assert_close, is_neox, head_dim, rot_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    cache = rope_cos_sin_cache(rot_dim, 64, 10000.0, device)
    positions = torch.tensor([0, 5, 5, 63, 17], device=device)  # repeats allowed
    # q and k as views of one fused projection with 3 query and 1 KV heads.
    fused = torch.randn(5, 3 + 1 + 1, head_dim, generator=gen).to(dtype).to(device)
    query, key = fused[:, :3], fused[:, 3:4]
    expected_q, expected_k = query.clone(), key.clone()
    untouched = fused[:, 4].clone()
    rotary_embedding(positions, query, key, cache, is_neox)
    rotary_embedding_ref(positions, expected_q, expected_k, cache, is_neox)
    assert_close(query, expected_q)
    assert_close(key, expected_k)
    assert torch.equal(fused[:, 4], untouched)  # the V part of the fused tensor
    assert torch.equal(query[0], expected_q[0])  # position 0 is the identity rotation


def test_reference_neox_matches_hf_rotate_half(device):
    # The spec's neox layout is HF Llama's: x * cos + rotate_half(x) * sin.
    gen = torch.Generator().manual_seed(1)
    cache = rope_cos_sin_cache(8, 16, 10000.0, device)
    x = torch.randn(3, 2, 8, generator=gen).to(device)
    positions = torch.tensor([1, 7, 15], device=device)
    cos = torch.cat([cache[positions, :4]] * 2, dim=-1)[:, None]
    sin = torch.cat([cache[positions, 4:]] * 2, dim=-1)[:, None]
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    hf = x * cos + rotate_half * sin
    q, k = x.clone(), x[:, :1].clone()
    rotary_embedding_ref(positions, q, k, cache, is_neox=True)
    torch.testing.assert_close(q, hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (48, 32)])
def test_per_token_tables_equal_the_models_torch_ops_bit_for_bit(
    device, dtype, head_dim, rotary_dim
):
    """The CUDA path of `apply_rotary_qk` (rounding each product, as the model's torch ops
    and Hugging Face do) against those torch ops, on q/k views of a fused projection."""
    from kvflow.gpu_worker.layers.rotary import RotaryEmbedding, apply_rotary

    emb = RotaryEmbedding(head_dim, {"partial_rotary_factor": rotary_dim / head_dim}, 4096)
    positions = torch.tensor([0, 3, 3, 2047, 900, 17], device=device)
    rope = emb.to(device)(positions, dtype)
    gen = torch.Generator().manual_seed(2)
    fused = (4 * torch.randn(6, 4 + 2 + 2, head_dim, generator=gen)).to(dtype).to(device)
    query, key, value = fused[:, :4], fused[:, 4:6], fused[:, 6:].clone()
    expected = []
    for x in (query, key):
        rotated = apply_rotary(x[..., :rotary_dim], rope)
        expected.append(torch.cat((rotated, x[..., rotary_dim:]), dim=-1))
    once = fused.clone()  # rounded once (the position-cache mode): not the model's bits
    rotary_embedding_tables(query, key, rope.cos.squeeze(1), rope.sin.squeeze(1))
    assert torch.equal(query, expected[0]) and torch.equal(key, expected[1])
    assert torch.equal(fused[:, 6:], value)
    tables = (rope.cos.squeeze(1), rope.sin.squeeze(1))
    rotary_embedding_tables(once[:, :4], once[:, 4:6], *tables, round_products=False)
    assert not torch.equal(once[:, :4], expected[0])

"""Rotary embedding (neox and interleaved layouts, full and partial) against its reference."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.rotary import rope_cos_sin_cache, rotary_embedding, rotary_embedding_ref


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

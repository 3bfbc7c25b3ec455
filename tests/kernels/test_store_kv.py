"""store_kv against its reference: exact copies, padding slots never written."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.store_kv import store_kv, store_kv_ref


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (2, 64, 16, torch.float32),
        (1, 40, 8, torch.bfloat16),  # MQA, head dim not a power of two
        (3, 128, 32, torch.bfloat16),  # head count not a power of two
        (2, 80, 24, torch.float32),  # block size not a power of two
    ],
)
def test_store_kv_matches_reference(device, num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 5
    # Scattered slots across blocks, with padding (-1) in the middle and at the end.
    slots = [3, block_size * 4 + block_size - 1, -1, block_size * 2, 0, block_size + 5, -1]
    num_tokens = len(slots)
    # K and V as views of one fused projection (strided rows), as the model produces them.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    fused = fused.to(device)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype).to(device)
    expected = cache.clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    store_kv(key, value, cache, slot_mapping)
    store_kv_ref(key, value, expected, slot_mapping)
    assert torch.equal(cache, expected)
    written = cache[:, 0, 3]  # slot 3 got token 0
    assert torch.equal(written[0], key[0]) and torch.equal(written[1], value[0])


def test_store_kv_rejects_mismatched_cache(device):
    key = torch.zeros(2, 2, 64, device=device)
    cache = torch.zeros(2, 4, 16, 2, 32, device=device)  # head_dim 32 != 64
    with pytest.raises(AssertionError):
        store_kv(key, key, cache, torch.zeros(2, dtype=torch.int64, device=device))

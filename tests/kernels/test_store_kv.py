"""store_kv against its reference: exact copies (quantized rows for a quantized cache),
padding slots never written."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import kv_codec
from kvflow.kernels.launch_utils import next_pow2
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


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_store_kv_takes_key_and_value_strides_apart(device, step_kv, kv_layout, cache_dtype):
    # K and V with different row strides (a view of the fused qkv output beside a copy).
    key, value = step_kv(5, 4, 2, 48, torch.float32, kv_layout)
    assert key.stride(0) != value.stride(0) or kv_layout == "both_views"
    width = kv_codec.row_width(48, cache_dtype)
    cache = torch.zeros(2, 3, 4, 2, width, device=device).to(cache_dtype)
    expected = cache.cpu().clone()
    slot_mapping = torch.tensor([9, 0, -1, 4, 11], dtype=torch.int64, device=device)
    store_kv(key, value, cache, slot_mapping)
    store_kv_ref(key.cpu(), value.cpu(), expected, slot_mapping.cpu())
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_store_kv_rejects_mismatched_cache(device):
    key = torch.zeros(2, 2, 64, device=device)
    cache = torch.zeros(2, 4, 16, 2, 32, device=device)  # head_dim 32 != 64
    with pytest.raises(AssertionError):
        store_kv(key, key, cache, torch.zeros(2, dtype=torch.int64, device=device))


QUANTIZED = list(kv_codec.CODEC_DTYPES.values())


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "src_dtype"),
    [(2, 64, torch.float32), (3, 40, torch.bfloat16)],  # 40: head dim not a power of two
)
def test_store_quantized_matches_quantize_rows(
    device, num_kv_heads, head_dim, src_dtype, cache_dtype
):
    gen = torch.Generator().manual_seed(1)
    block_size, num_blocks = 8, 4
    slots = [5, -1, block_size * 3 + 7, 0, block_size * 2 + 1]
    num_tokens = len(slots)
    # Rows from 1e-6 to 1e4 in magnitude, one all-zero row (scale 0) and one of -0.0.
    magnitude = torch.logspace(-6, 4, num_tokens)[:, None, None]
    kv = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen) * magnitude
    kv[0, 0, 1] = 0.0
    kv[1, 3, 0] = -0.0
    key, value = (x.to(src_dtype).to(device) for x in kv)
    width = head_dim + kv_codec.SCALE_BYTES
    cache = torch.randint(0, 256, (2, num_blocks, block_size, num_kv_heads, width), generator=gen)
    cache = cache.to(torch.uint8).view(cache_dtype).to(device)
    expected = cache.cpu().clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    store_kv(key, value, cache, slot_mapping)
    # Bit for bit, untouched slots included. The reference runs on the CPU, where torch
    # divides by qmax as the kernel does (IEEE); on a GPU it may take the reciprocal.
    store_kv_ref(key.cpu(), value.cpu(), expected, slot_mapping.cpu())
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_store_rounds_ties_to_even(device, cache_dtype):
    # A row whose max is qmax has scale 1 exactly, so its values are quantized as they are:
    # every midpoint between two neighbouring codes (fp8 subnormals included) must round to
    # the code whose last bit is 0, as torch's round (int8) and fp8 casts do.
    if cache_dtype == torch.int8:
        codes = torch.arange(0, 128).float()
    else:
        codes = torch.arange(0, 127, dtype=torch.uint8).view(cache_dtype).float()  # +0 .. max
        codes = codes[codes.isfinite()]
    midpoints = (codes[:-1] + codes[1:]) / 2
    qmax = codes.max()
    width = next_pow2(len(midpoints) + 1)
    row = torch.full((width,), float(qmax))
    row[: len(midpoints)] = midpoints
    rows = torch.stack([row, -row])[:, None, :].to(device)  # [2 tokens, 1 head, width]
    cache = torch.zeros(2, 1, 2, 1, width + kv_codec.SCALE_BYTES, dtype=cache_dtype, device=device)
    store_kv(rows, rows, cache, torch.tensor([0, 1], dtype=torch.int64, device=device))
    expected = kv_codec.quantize_rows(rows.cpu(), cache_dtype)  # CPU: see above
    assert torch.equal(cache[0, 0].cpu().view(torch.uint8), expected.view(torch.uint8))
    stored = cache[0, 0, 0, 0, : len(midpoints)].cpu().view(torch.uint8)
    assert torch.equal(stored & 1, torch.zeros_like(stored))

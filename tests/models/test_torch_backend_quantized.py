"""TorchAttentionBackend over a quantized KV cache (kernels/kv_codec.py rows).

The reference attends dense per-request histories, with the values a correct backend
must see: dequantized ones wherever the request reads the cache (decodes, a chunk over a
cached prefix: its own fresh rows are stored first and read back too), the raw K/V for a
fresh prefill. Float32 queries make the tolerance (1e-5) far tighter than the codecs'
rounding (~1e-2), so reading the wrong kind of value fails. Unwritten rows are all 0xFF
bytes: a NaN scale, so a read of one poisons the output.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.gpu_worker.attention.backend import get_attention_backend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels import kv_codec
from kvflow.kernels.cpu import elementwise

CODECS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]

CASES = {
    # q_lens, seq_lens, heads, kv_heads, head_dim, block_size, padding, window
    "decodes-gqa4": ([1, 1, 1, 1], [1, 7, 16, 33], 8, 2, 16, 4, 0, None),
    "mixed-hd13": ([1, 6, 1, 5, 3], [9, 6, 30, 12, 3], 4, 4, 13, 4, 3, None),
    "mixed-window": ([4, 1, 1, 9], [20, 18, 3, 9], 6, 2, 32, 8, 2, 5),
    "chunk-mqa": ([7, 1], [25, 40], 4, 1, 24, 16, 0, 11),
}


def _reference(q, k, v, scale, window):  # q [Lq, H, D], k/v [L, KH, D] -> [Lq, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - (window or k.shape[0] + 1))
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _roundtrip(x: torch.Tensor, codec: torch.dtype) -> torch.Tensor:
    return kv_codec.dequantize_rows(kv_codec.quantize_rows(x, codec), x.dtype)


def _case(name: str, codec: torch.dtype, dtype: torch.dtype):
    q_lens, seq_lens, _, kv_heads, head_dim, block_size, padding, _ = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    width = kv_codec.row_width(head_dim, codec)
    cache = torch.full((2, num_blocks, block_size, kv_heads, width), 255, dtype=torch.uint8)
    cache = cache.view(codec)
    flat = cache.view(2, -1, kv_heads, width)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(
        len(seq_lens), max(-(-s // block_size) for s in seq_lens), dtype=torch.int32
    )
    histories, slots = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        blocks = [order.pop() for _ in range(-(-seq_len // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(seq_len)
        pos_slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k, v = (torch.randn(seq_len, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
        cached = pos_slots[: seq_len - q_len]
        flat[0, cached] = kv_codec.quantize_rows(k[: seq_len - q_len], codec)
        flat[1, cached] = kv_codec.quantize_rows(v[: seq_len - q_len], codec)
        histories.append((k, v))
        slots += pos_slots[seq_len - q_len :].tolist()
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * padding),
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


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", CODECS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_dequantized_reference(
    name: str, codec: torch.dtype, dtype: torch.dtype, backend_name: str
) -> None:
    """ "cpu" runs the native store and decode kernels where they take the cache, so
    they meet the same reference as the torch paths."""
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size, padding, window = CASES[name]
    cache, histories, md = _case(name, codec, dtype)
    g = torch.Generator().manual_seed(7)
    query = torch.randn(sum(q_lens) + padding, heads, head_dim, generator=g).to(dtype)
    tails = [(k[s - q :], v[s - q :]) for (k, v), q, s in zip(histories, q_lens, seq_lens)]
    pad = torch.zeros(padding, kv_heads, head_dim, dtype=dtype)
    key = torch.cat([k for k, _ in tails] + [pad])
    value = torch.cat([v for _, v in tails] + [pad])
    scale = head_dim**-0.5
    out = get_attention_backend(backend_name).forward(query, key, value, cache, md, scale, window)
    assert out.shape == query.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if backend_name == "cpu" and codec == torch.int8 and dtype == torch.float32:
        # The native int8 decode scores an int16-rounded query against the codes with
        # VNNI (kernels/cpu/paged_decode_quant_avx512.h): ~5e-5 from that rounding.
        tol = 2e-4
    starts = md.query_start_loc_cpu
    for i, ((k, v), q_len, seq_len) in enumerate(zip(histories, q_lens, seq_lens)):
        if q_len == 1 or q_len < seq_len:  # reads its context back from the cache
            k, v = _roundtrip(k, codec), _roundtrip(v, codec)
        rows = slice(starts[i], starts[i + 1])
        expected = _reference(query[rows], k, v, scale, window)
        torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)
    assert torch.equal(out[starts[-1] :], torch.zeros(padding, heads, head_dim, dtype=dtype))
    # The step's rows are stored as the codec's reference encodes them; padding wrote none.
    stored = md.slot_mapping[md.slot_mapping >= 0]
    flat = cache.view(2, -1, kv_heads, head_dim + 4).view(torch.uint8)
    for plane, fresh in enumerate((key, value)):
        want = kv_codec.quantize_rows(fresh[: starts[-1]], codec).view(torch.uint8)
        assert torch.equal(flat[plane, stored], want)
    unwritten = sum(-(-s // block_size) * block_size - s for s in seq_lens) + 2 * block_size
    assert int((flat[0] == 255).all(-1).all(-1).sum()) == unwritten


@pytest.mark.parametrize("codec", CODECS, ids=lambda d: str(d).removeprefix("torch."))
def test_reference_store_quantizes_only_set_slots(
    codec: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index_copy_ store (where no native store applies) drops slot -1 rows before
    quantizing (their huge values would otherwise land somewhere), and each written row
    decodes within half a code step."""
    monkeypatch.setattr(elementwise, "store_applies", lambda *_: False)
    name = "mixed-hd13"
    cache, histories, md = _case(name, codec, torch.float32)
    q_lens, seq_lens, heads, kv_heads, head_dim, *_ = CASES[name]
    tails = [(k[s - q :], v[s - q :]) for (k, v), q, s in zip(histories, q_lens, seq_lens)]
    pad = torch.full((3, kv_heads, head_dim), 1e30)  # would overflow a real row's scale
    key = torch.cat([k for k, _ in tails] + [pad])
    value = torch.cat([v for _, v in tails] + [pad])
    query = torch.randn(key.shape[0], heads, head_dim)
    get_attention_backend("torch").forward(query, key, value, cache, md, head_dim**-0.5)
    stored = md.slot_mapping[md.slot_mapping >= 0]
    rows = cache.view(2, -1, kv_heads, head_dim + 4)[0, stored]
    back = kv_codec.dequantize_rows(rows)
    assert torch.isfinite(back).all()
    # Half a code step of the row's largest value: 1/254 for int8; a float code's
    # relative rounding, 2**-4 with e4m3's 3 mantissa bits and 2**-3 with e5m2's 2.
    half_step = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}
    row_max = key[: len(stored)].abs().amax(-1, keepdim=True)
    error = (back - key[: len(stored)]).abs()
    assert (error <= row_max * half_step[codec] * 1.001).all()

"""Paged attention launchers (unified and split-KV), the chooser, and the torch reference.

Semantics (the reference below is the spec): request r owns query rows
`query_start_loc[r] : query_start_loc[r+1]`, the last q_len tokens of its `seq_lens[r]`
context; query i (absolute position p = seq_len - q_len + i) attends causally to context
positions 0..p, and with a sliding window W only to those with p - key < W. Query head h
reads KV head h // (num_heads // num_kv_heads). Rows of padding tokens (past
query_start_loc[-1]) are zero in a freshly allocated output. A quantized cache
(kernels/kv_codec.py, any model dtype) is read as its dequantized values. With `sinks`
[num_heads] (gpt-oss), query head h's softmax denominator also holds exp(sinks[h]), a
logit with no value (gpu_worker/attention/softcap.py states it in torch ops).

How the kernels map programs to requests and tiles: `paged_attention_kernels.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kvflow.kernels import kv_codec
from kvflow.kernels.kv_codec_triton import codec_id, kernel_view
from kvflow.kernels.launch_utils import (
    assert_last_dim_contiguous,
    check_device,
    dot_dtype,
    dot_precision,
    is_interpreted,
    next_pow2,
    num_sms,
)
from kvflow.kernels.paged_attention_kernels import (
    _paged_attention_kernel,
    _split_kv_merge_kernel,
)

# This step's (key, value), [num_tokens, num_kv_heads, head_dim] each, as computed.
FreshKV = tuple[torch.Tensor, torch.Tensor]

# Without a window, the kernels get one wider than any context, so it never masks.
_NO_WINDOW = 1 << 30
# The split-KV chooser: only for decode-like batches, at most this many splits, and
# each split must get at least this many keys to pay for its share of the merge.
_MAX_SPLIT_QUERY_LEN = 1
_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 256
# Keys per inner-loop step. Decode-only batches stream the most cache per query row: on
# an H100, 64 keys beat 32 by 2% (b64 x 2k, 8 KV heads of 128) to 25% (3 KV heads of 64)
# in tests/gpu/decode_attention_sweep.py; 128 was slower in both (docs/benchmarks.md).
_DECODE_TILE_N = 64
_TILE_N = 32


@dataclass(frozen=True)
class SplitKVScratch:
    """fp32 partials of split-KV attention. Allocate once (e.g. before CUDA-graph capture)
    for the largest batch and split count; any smaller launch uses a prefix of it."""

    acc: torch.Tensor  # [max_tokens, num_heads, max_splits, head_dim] fp32
    max_logit: torch.Tensor  # [max_tokens, num_heads, max_splits] fp32, log2 domain
    sum_exp: torch.Tensor  # [max_tokens, num_heads, max_splits] fp32

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        max_splits: int,
        device: torch.device | str,
    ) -> SplitKVScratch:
        shape = (max_tokens, num_heads, max_splits)
        return cls(
            acc=torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
            max_logit=torch.empty(shape, dtype=torch.float32, device=device),
            sum_exp=torch.empty(shape, dtype=torch.float32, device=device),
        )

    def fits(self, num_tokens: int, num_heads: int, head_dim: int, num_splits: int) -> bool:
        t, h, s, d = self.acc.shape
        return num_tokens <= t and num_heads == h and num_splits <= s and head_dim == d


@dataclass(frozen=True)
class _Tiling:
    group: int  # query heads per KV head
    block_m: int  # rows of a program's tile = block_q tokens x group heads (padded)
    block_q: int
    tile_n: int  # keys per inner-loop step
    # Triton's launch options; None: Triton's defaults (tests/gpu/decode_attention_sweep.py
    # times the alternatives on a GPU).
    num_warps: int | None = None
    num_stages: int | None = None

    def launch_options(self) -> dict[str, int]:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return {name: value for name, value in options.items() if value is not None}


def _tiling(
    num_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    tile_n: int,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> _Tiling:
    """16 rows at least (tl.dot's minimum), up to 64 for prefill-sized tiles."""
    group = num_heads // num_kv_heads
    block_m = max(next_pow2(group), min(64, max(16, next_pow2(max_query_len * group))))
    assert tile_n >= 16 and tile_n == next_pow2(tile_n), tile_n
    return _Tiling(group, block_m, block_m // group, tile_n, num_warps, num_stages)


def _check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    fresh_kv: FreshKV | None,
    sinks: torch.Tensor | None = None,
) -> None:
    num_heads, head_dim = query.shape[1:]
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.is_floating_point(), sinks.shape
        check_device(_paged_attention_kernel, query, sinks)
    assert query.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
    assert kv_codec.head_dim_of(kv_cache) == head_dim, (kv_cache.shape, query.shape)
    assert num_heads % kv_cache.shape[3] == 0, (num_heads, kv_cache.shape)
    # A float cache holds the model dtype; a quantized one (any model dtype) its codes.
    quantized = kv_codec.is_quantized(kv_cache.dtype)
    assert quantized or query.dtype == kv_cache.dtype, (query.dtype, kv_cache.dtype)
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and block_tables.shape[0] == num_reqs
    for t in (query_start_loc, seq_lens, block_tables):
        assert t.dtype == torch.int32, t.dtype
    assert_last_dim_contiguous("query", query)
    assert_last_dim_contiguous("kv_cache", kv_cache)
    assert_last_dim_contiguous("block_tables", block_tables)
    check_device(_paged_attention_kernel, query, kv_cache, query_start_loc, block_tables)
    if fresh_kv is not None:
        key, value = fresh_kv
        assert key.shape == value.shape == (query.shape[0], kv_cache.shape[3], head_dim)
        assert key.dtype == value.dtype == query.dtype, (key.dtype, query.dtype)
        # Each with its own strides: views of the fused qkv output or contiguous copies.
        assert_last_dim_contiguous("key", key)
        assert_last_dim_contiguous("value", value)
        check_device(_paged_attention_kernel, key, value)


def _launch(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    sliding_window: int | None,
    tiling: _Tiling,
    num_splits: int,
    scratch: SplitKVScratch | None,
    fresh_kv: FreshKV | None,
    sinks: torch.Tensor | None,
) -> None:
    """One launch of the attention kernel: writes `out` (1 split) or `scratch` partials."""
    num_tokens, _, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    # Only a quantized cache stores rows other than the fresh ones; a float cache keeps one
    # kernel variant for every request.
    use_fresh = fresh_kv is not None and kv_codec.is_quantized(kv_cache.dtype)
    key, value = fresh_kv if fresh_kv is not None and use_fresh else (query, query)
    # One split writes `out` directly; the scratch pointers are then unused placeholders.
    acc, max_logit, sum_exp = (
        (out, out, out) if scratch is None else (scratch.acc, scratch.max_logit, scratch.sum_exp)
    )
    operand = dot_dtype(_paged_attention_kernel, query.dtype)
    grid = (num_tokens // tiling.block_q + num_reqs, kv_cache.shape[3], num_splits)
    if num_tokens == 0:
        return
    _paged_attention_kernel[grid](
        out, acc, max_logit, sum_exp, query, key, value, kernel_view(kv_cache),
        query_start_loc, seq_lens, block_tables, query if sinks is None else sinks, num_reqs,
        scale * math.log2(math.e),
        _NO_WINDOW if sliding_window is None else sliding_window,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2) if acc.dim() == 4 else 0,
        max_logit.stride(0), max_logit.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), head_dim,
        NUM_SPLITS=num_splits, GROUP=tiling.group, BLOCK_M=tiling.block_m,
        BLOCK_Q=tiling.block_q, HEAD_DIM_P=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=kv_cache.shape[2], TILE_N=tiling.tile_n,
        USE_WINDOW=sliding_window is not None, FRESH_KV=use_fresh,
        KV_CODEC=codec_id(kv_cache.dtype),
        DOT_DTYPE=operand, DOT_PRECISION=dot_precision(operand), HAS_SINKS=sinks is not None,
        **tiling.launch_options(),
    )  # fmt: skip


def unified_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    tile_n: int = _TILE_N,
    fresh_kv: FreshKV | None = None,  # this step's (key, value) [num_tokens, kv_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads]
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention for a mixed batch in one launch; each program owns a query tile."""
    _check_inputs(query, kv_cache, query_start_loc, seq_lens, block_tables, fresh_kv, sinks)
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1
    tiling = _tiling(
        query.shape[1], kv_cache.shape[3], max_query_len, tile_n, num_warps, num_stages
    )
    _launch(out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale,
            sliding_window, tiling, num_splits=1, scratch=None, fresh_kv=fresh_kv,
            sinks=sinks)  # fmt: skip
    return out


def split_kv_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int,
    num_splits: int,
    scratch: SplitKVScratch | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    tile_n: int = _TILE_N,
    fresh_kv: FreshKV | None = None,  # this step's (key, value) [num_tokens, kv_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads]
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Flash-decoding: stage 1 spreads each tile's keys over `num_splits` programs writing
    fp32 partials to `scratch`; stage 2 merges them. Pass a preallocated `scratch` and a
    fixed `num_splits` to make the pair capturable in a CUDA graph."""
    _check_inputs(query, kv_cache, query_start_loc, seq_lens, block_tables, fresh_kv, sinks)
    num_tokens, num_heads, head_dim = query.shape
    assert num_splits >= 1, num_splits
    if scratch is None:
        scratch = SplitKVScratch.allocate(num_tokens, num_heads, head_dim, num_splits, query.device)
    assert scratch.fits(num_tokens, num_heads, head_dim, num_splits), scratch.acc.shape
    assert scratch.acc.is_contiguous() and scratch.max_logit.is_contiguous()
    assert scratch.sum_exp.stride() == scratch.max_logit.stride()
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1
    tiling = _tiling(num_heads, kv_cache.shape[3], max_query_len, tile_n, num_warps, num_stages)
    _launch(out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale,
            sliding_window, tiling, num_splits=num_splits, scratch=scratch,
            fresh_kv=fresh_kv, sinks=sinks)  # fmt: skip
    if num_tokens == 0:
        return out
    # Compiled: one head per program (its partials fit in registers). Interpreted: all
    # heads per program, since the interpreter's cost grows with the number of programs.
    heads_per_program = next_pow2(num_heads) if is_interpreted(_split_kv_merge_kernel) else 1
    grid = (num_tokens, triton.cdiv(num_heads, heads_per_program))
    _split_kv_merge_kernel[grid](
        out, scratch.acc, scratch.max_logit, scratch.sum_exp,
        query_start_loc, seq_lens.shape[0],
        out.stride(0), out.stride(1),
        scratch.acc.stride(0), scratch.acc.stride(1), scratch.acc.stride(2),
        scratch.max_logit.stride(0), scratch.max_logit.stride(1), num_heads, head_dim,
        NUM_SPLITS=num_splits, SPLITS_P=next_pow2(num_splits),
        HEADS_P=heads_per_program, HEAD_DIM_P=next_pow2(head_dim),
    )  # fmt: skip
    return out


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """1 (unified kernel) unless a decode batch gives fewer programs than SMs; then split
    each context so that about two programs per SM run, keeping >= 256 keys per split."""
    programs = num_reqs * num_kv_heads
    if max_query_len > _MAX_SPLIT_QUERY_LEN or programs == 0 or programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    by_length = max_seq_len // _MIN_KEYS_PER_SPLIT
    return max(1, min(_MAX_SPLITS, by_occupancy, by_length))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    scratch: SplitKVScratch | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    fresh_kv: FreshKV | None = None,  # this step's (key, value) [num_tokens, kv_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Unified or split-KV attention, chosen from host-side sizes (no device sync).

    `num_splits` overrides the choice (CUDA graphs need it fixed per captured shape).
    With `fresh_kv` over a quantized cache, a request with no cached prefix attends these
    rows as computed rather than their quantized copies (what the torch backend does)."""
    if num_splits is None:
        num_splits = choose_num_splits(
            seq_lens.shape[0], kv_cache.shape[3], max_query_len, max_seq_len,
            num_sms(query.device),
        )  # fmt: skip
    common = (query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window)
    tile_n = choose_tile_n(max_query_len)
    if num_splits == 1:
        return unified_paged_attention(
            *common, max_query_len=max_query_len, out=out, tile_n=tile_n, fresh_kv=fresh_kv,
            sinks=sinks,
        )  # fmt: skip
    return split_kv_paged_attention(
        *common, max_query_len=max_query_len, num_splits=num_splits, scratch=scratch, out=out,
        tile_n=tile_n, fresh_kv=fresh_kv, sinks=sinks,
    )  # fmt: skip


def choose_tile_n(max_query_len: int) -> int:
    """Keys per inner-loop step: wider for decode-only batches."""
    return _DECODE_TILE_N if max_query_len <= 1 else _TILE_N


def _as_float(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as fp32 values: dequantized if the cache is quantized."""
    return kv_codec.dequantize_rows(rows) if kv_codec.is_quantized(rows.dtype) else rows.float()


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    fresh_kv: FreshKV | None = None,  # this step's (key, value) [num_tokens, kv_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Reference (the spec): per request, gather its context (dequantized, for a quantized
    cache; `fresh_kv`'s rows for a request with no cached prefix, if given) and run masked
    softmax in fp32."""
    out = torch.zeros_like(query)
    group = query.shape[1] // kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[r], starts[r + 1]
        pos = torch.arange(seq_len, device=query.device)  # [seq_len] context positions
        blocks = block_tables[r, pos // block_size].long()
        if fresh_kv is not None and q1 - q0 == seq_len:
            k, v = (x[q0:q1].float().repeat_interleave(group, dim=1) for x in fresh_kv)
        else:
            k = _as_float(kv_cache[0, blocks, pos % block_size]).repeat_interleave(group, dim=1)
            v = _as_float(kv_cache[1, blocks, pos % block_size]).repeat_interleave(group, dim=1)
        q_pos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=query.device)  # [q_len]
        delta = q_pos[:, None] - pos[None, :]  # [q_len, seq_len] query pos - key pos
        allowed = delta >= 0
        if sliding_window is not None:
            allowed &= delta < sliding_window
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))  # [H, q_len, seq_len]
        if sinks is not None:  # one more column in the softmax, then dropped
            sink = sinks.float()[:, None, None].expand(-1, q1 - q0, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out

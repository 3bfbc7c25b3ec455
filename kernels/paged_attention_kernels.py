"""Paged attention over a whole mixed batch (prefills, chunked prefills, decodes) in one launch.

Inputs follow `gpu_worker/attn_metadata.py`: request r owns query rows
`query_start_loc[r] : query_start_loc[r+1]`; they are the *last* q_len tokens of its
`seq_lens[r]`-token context, so query i sits at absolute position `seq_len - q_len + i`
and sees context positions `0 .. seq_len - q_len + i` (and, with a sliding window W, only
those with `position - key < W`, the Mistral/HF convention). Context token n lives in
`kv_cache[:, block_tables[r, n // block_size], n % block_size]`.

Work split (grouped GQA): a program owns one KV head and a tile of BLOCK_Q query tokens
of one request, with all GROUP = num_heads // num_kv_heads query heads of that KV head as
the rows of its tile, so every K/V tile it loads is used by the whole group::

    row m of the tile  ->  token  q_tile * BLOCK_Q + m // GROUP,  head  kv_head * GROUP + m % GROUP

Finding the request of a program: the grid is flat over query tiles, with request r's
tiles starting at global tile `query_start_loc[r] // BLOCK_Q + r`. Those starts are
increasing and spaced at least ceil(q_len / BLOCK_Q) apart, and the last tile is below
`num_tokens // BLOCK_Q + num_reqs`, which is therefore the grid size. Each program
binary-searches query_start_loc for its request (as vLLM's unified attention does)
instead of reading a host-built tile->request map: the grid depends only on tensor
shapes, there is no extra tensor to build per step, and nothing syncs with the host, so
the launch can be captured in a CUDA graph. Programs past the last tile of their request
exit at once.

The split-KV (flash-decoding) variant divides each program's key range into NUM_SPLITS
chunks run by separate programs (stage 1), each writing a partial (max, sum, acc) in fp32
to a scratch buffer; stage 2 merges the partials. It keeps the GPU busy when few requests
with long contexts would otherwise give it few programs. Both variants share the one
inner loop `attend_range` (paged_attention_loop.py).

A quantized cache (kernels/kv_codec.py: 8-bit codes plus an fp32 scale per (token, KV
head) row) reaches the kernel as bytes, row stride head_dim + 4; the inner loop
(paged_attention_loop.py) applies the scales.

With FRESH_KV, a request with no cached prefix reads this step's own K/V rows (float,
unquantized) instead of the cache: the same inner loop, its keys addressed row after row.
K and V come with their own strides: they are views of the fused qkv projection, or a
contiguous copy (rotary's or a norm's output), in any mix.

With HAS_SINKS (gpt-oss), query head h's softmax denominator also holds exp(sinks[h]), a
logit with no value. The sink starts the online softmax of each row as a key already
seen (max = the sink, sum = 1, acc = 0); with split-KV only split 0 starts from it, the
others from nothing, and the merge weighs them as usual.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvflow.kernels.kv_codec_triton import FLOAT
from kvflow.kernels.launch_utils import round_to
from kvflow.kernels.paged_attention_loop import attend_range

LOG2E = tl.constexpr(1.4426950408889634)  # the kernels' logits are in the log2 domain


@triton.jit
def _find_request(
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    tile_idx,
    BLOCK_Q: tl.constexpr,
):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= tile_idx (see module doc)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _locate_tile(
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    num_reqs,
    BLOCK_Q: tl.constexpr,
):
    """(request, its first query row, q_len, context length before it, tile within it)."""
    tile_idx = tl.program_id(0)
    req = _find_request(query_start_loc_ptr, num_reqs, tile_idx, BLOCK_Q=BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + req) - q_len
    q_tile = tile_idx - (q_start // BLOCK_Q + req)
    return req, q_start, q_len, ctx_len, q_tile


@triton.jit
def _tile_rows(
    q_tile,
    q_len,
    ctx_len,
    sliding_window,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Per-row token/head/mask/position of a tile and the key range [lo, hi) it needs.

    Without a window the launcher passes a window larger than any context, so lo is 0.
    """
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query token within its request
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok  # [BLOCK_M]
    lo = tl.maximum(ctx_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
    hi = ctx_len + tl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q)
    return tok, offs_m % GROUP, mask_m, q_pos, lo, hi


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_DIM_P] in DOT_DTYPE
    q_pos,  # [BLOCK_M] int32, absolute position of each row's query token
    q_start, req, kv_head, ctx_len, lo, hi, split,
    sinks_ptr,  # [num_heads] (HAS_SINKS)
    head,  # [BLOCK_M] query head of each row
    mask_m,  # [BLOCK_M] real rows
    key_ptr,  # [num_tokens, num_kv_heads, head_dim] this step's keys   (FRESH_KV)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] and values          (FRESH_KV)
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 if quantized)]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    qk_scale, sliding_window,
    stride_kt, stride_kh,  # key_ptr (token, head)
    stride_vt, stride_vh,  # value_ptr (token, head)
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,  # kv_cache_ptr
    stride_bt,  # block_tables_ptr (request)
    offs_d, mask_d, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    FRESH_KV: tl.constexpr, KV_CODEC: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """(acc, l_i, m_i) of this tile over split `split` of its key range [lo, hi)."""
    # Split s takes a whole number of key tiles; trailing splits may get none and then
    # write (max=-inf, sum=0, acc=0), which the merge weighs as nothing.
    per_split = tl.cdiv(tl.cdiv(hi - lo, TILE_N), NUM_SPLITS) * TILE_N
    split_lo = lo + split * per_split
    split_hi = tl.minimum(hi, split_lo + per_split)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if HAS_SINKS:  # split 0 starts from the sink: a key seen, weight 1, no value
        sink = tl.load(sinks_ptr + head, mask=mask_m, other=0.0).to(tl.float32) * LOG2E
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    fresh = False
    if FRESH_KV:
        fresh = ctx_len == 0
    if fresh:
        # No cached prefix: the request attends its own K/V as computed, not as stored
        # (quantized), row after row from this step's key/value tensors.
        k_off = q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_off = q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        acc, l_i, m_i = attend_range(
            acc, l_i, m_i, q, q_pos, key_ptr + k_off, value_ptr + v_off,
            block_tables_ptr, split_lo, split_hi, qk_scale, sliding_window, 0, stride_kt,
            stride_vt, offs_d, mask_d, head_dim,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, USE_WINDOW=USE_WINDOW, PAGED=False,
            KV_CODEC=FLOAT, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    else:
        kv_base = kv_cache_ptr + kv_head * stride_c_head
        acc, l_i, m_i = attend_range(
            acc, l_i, m_i, q, q_pos, kv_base, kv_base + stride_c_kv,
            block_tables_ptr + req * stride_bt, split_lo, split_hi, qk_scale, sliding_window,
            stride_c_block, stride_c_slot, 0, offs_d, mask_d, head_dim,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, USE_WINDOW=USE_WINDOW, PAGED=True,
            KV_CODEC=KV_CODEC, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _store_tile(
    acc,  # [BLOCK_M, HEAD_DIM_P] fp32, unnormalised output
    l_i,  # [BLOCK_M] fp32, sum of exp2
    m_i,  # [BLOCK_M] fp32, max (log2 domain)
    out_ptr, acc_ptr, max_ptr, sum_ptr,  # as in _paged_attention_kernel
    rows,  # [BLOCK_M] int64 query token of each row
    head,  # [BLOCK_M] query head of each row
    split, mask_m, mask_md, offs_d,
    stride_ot, stride_oh,  # out_ptr (token, head)
    stride_at, stride_ah, stride_as,  # acc_ptr (token, head, split)
    stride_mt, stride_mh,  # max_ptr and sum_ptr (token, head)
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """One split writes the normalised output; several write their fp32 partials."""
    if NUM_SPLITS == 1:
        # l_i > 0 on real rows (a query sees itself); padded rows divide by 1, not 0.
        out = acc / tl.where(mask_m, l_i, 1.0)[:, None]  # [BLOCK_M, HEAD_DIM_P]
        o_off = rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + o_off, round_to(out, out_dtype).to(out_dtype), mask=mask_md)
    else:
        ml_off = rows * stride_mt + head * stride_mh + split  # [BLOCK_M]
        tl.store(max_ptr + ml_off, m_i, mask=mask_m)
        tl.store(sum_ptr + ml_off, l_i, mask=mask_m)
        a_off = rows[:, None] * stride_at + head[:, None] * stride_ah + split * stride_as
        tl.store(acc_ptr + a_off + offs_d[None, :], acc, mask=mask_md)


# num_reqs changes every step; specialising on it (== 1, % 16 == 0) would compile new
# variants mid-serving (~0.3 s each on an H100) for no speed-up.
@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]              (NUM_SPLITS == 1)
    acc_ptr,  # [max_tokens, num_heads, max_splits, head_dim] fp32 (NUM_SPLITS > 1)
    max_ptr,  # [max_tokens, num_heads, max_splits] fp32, log2 domain (NUM_SPLITS > 1)
    sum_ptr,  # [max_tokens, num_heads, max_splits] fp32          (NUM_SPLITS > 1)
    q_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim] this step's keys   (FRESH_KV)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] and values          (FRESH_KV)
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 if quantized)]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    sinks_ptr,  # [num_heads] (HAS_SINKS)
    num_reqs, qk_scale, sliding_window,
    stride_qt, stride_qh,  # q_ptr (token, head)
    stride_kt, stride_kh,  # key_ptr (token, head)
    stride_vt, stride_vh,  # value_ptr (token, head)
    stride_ot, stride_oh,  # out_ptr (token, head)
    stride_at, stride_ah, stride_as,  # acc_ptr (token, head, split)
    stride_mt, stride_mh,  # max_ptr and sum_ptr (token, head)
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,  # kv_cache_ptr
    stride_bt, head_dim,  # block_tables_ptr (request); the real head size
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, FRESH_KV: tl.constexpr,
    KV_CODEC: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, num_kv_heads, NUM_SPLITS). One split writes the output itself;
    several write fp32 partials for `_split_kv_merge_kernel`."""
    req, q_start, q_len, ctx_len, q_tile = _locate_tile(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, BLOCK_Q=BLOCK_Q
    )
    if q_tile * BLOCK_Q >= q_len:
        return
    kv_head, split = tl.program_id(1), tl.program_id(2)
    tok, head_in_group, mask_m, q_pos, lo, hi = _tile_rows(
        q_tile, q_len, ctx_len, sliding_window, BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, GROUP=GROUP
    )
    head = kv_head * GROUP + head_in_group  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask_d = offs_d < head_dim
    mask_md = mask_m[:, None] & mask_d[None, :]
    rows = (q_start + tok).to(tl.int64)  # [BLOCK_M]
    q_off = rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_md, other=0.0).to(tl.float32).to(DOT_DTYPE)
    acc, l_i, m_i = _attend_tile(
        q, q_pos, q_start, req, kv_head, ctx_len, lo, hi, split, sinks_ptr, head, mask_m,
        key_ptr, value_ptr, kv_cache_ptr, block_tables_ptr, qk_scale, sliding_window,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_c_kv, stride_c_block, stride_c_slot,
        stride_c_head, stride_bt, offs_d, mask_d, head_dim,
        NUM_SPLITS=NUM_SPLITS, BLOCK_M=BLOCK_M, HEAD_DIM_P=HEAD_DIM_P, BLOCK_SIZE=BLOCK_SIZE,
        TILE_N=TILE_N, USE_WINDOW=USE_WINDOW, FRESH_KV=FRESH_KV, KV_CODEC=KV_CODEC,
        DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION, HAS_SINKS=HAS_SINKS,
    )  # fmt: skip
    _store_tile(
        acc, l_i, m_i, out_ptr, acc_ptr, max_ptr, sum_ptr, rows, head, split, mask_m,
        mask_md, offs_d, stride_ot, stride_oh, stride_at, stride_ah, stride_as, stride_mt,
        stride_mh, NUM_SPLITS=NUM_SPLITS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_reqs"])
def _split_kv_merge_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    acc_ptr,  # [max_tokens, num_heads, max_splits, head_dim] fp32 scratch
    max_ptr,  # [max_tokens, num_heads, max_splits] fp32 scratch (log2 domain)
    sum_ptr,  # [max_tokens, num_heads, max_splits] fp32 scratch
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    stride_ot,
    stride_oh,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """Grid (num_tokens, cdiv(num_heads, HEADS_P)): merge the partials of HEADS_P heads."""
    token = tl.program_id(0)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # a padding token: no partials were written for it
    offs_h = tl.program_id(1) * HEADS_P + tl.arange(0, HEADS_P)  # [HEADS_P]
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask_hs = (offs_h[:, None] < num_heads) & (offs_s[None, :] < NUM_SPLITS)
    ml_off = token.to(tl.int64) * stride_mt + offs_h[:, None] * stride_mh + offs_s[None, :]
    m_s = tl.load(max_ptr + ml_off, mask=mask_hs, other=float("-inf"))  # [HEADS_P, SPLITS_P]
    l_s = tl.load(sum_ptr + ml_off, mask=mask_hs, other=0.0)
    # Real heads have a finite max (every query sees itself); padded heads get 0 instead.
    m_all = tl.max(m_s, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # [HEADS_P]
    w = tl.math.exp2(m_s - m_all[:, None])  # [HEADS_P, SPLITS_P], 0 for empty splits
    l_all = tl.sum(l_s * w, axis=1)
    l_all = tl.where(l_all == 0.0, 1.0, l_all)  # [HEADS_P]
    a_off = token.to(tl.int64) * stride_at + offs_h[:, None, None] * stride_ah
    a_off += offs_s[None, :, None] * stride_as + offs_d[None, None, :]
    a_mask = mask_hs[:, :, None] & (offs_d[None, None, :] < head_dim)
    acc = tl.load(acc_ptr + a_off, mask=a_mask, other=0.0)  # [HEADS_P, SPLITS_P, HEAD_DIM_P]
    out = tl.sum(acc * w[:, :, None], axis=1) / l_all[:, None]  # [HEADS_P, HEAD_DIM_P]
    o_off = token.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    o_mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_off, round_to(out, out_dtype).to(out_dtype), mask=o_mask)

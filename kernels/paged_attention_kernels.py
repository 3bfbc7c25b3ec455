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
inner loop `_attend_range` (online softmax in fp32, exp2 with log2(e) folded into scale).

A quantized cache (kernels/kv_codec.py: 8-bit codes plus an fp32 scale per (token, KV
head) row) reaches the kernel as bytes, row stride head_dim + 4. Its codes go to the dot
operands unscaled (every int8 / fp8 code is exact in bf16 and fp16), and the per-row
scales are folded in where they cost one multiply per key instead of one per element:
scores are `(q . k_codes) * s_k` per key column, and the softmax weights are multiplied
by `s_v` per key before the P.V dot (the running sum still adds the unscaled weights;
with fp16 operands V is dequantized instead, as `p * s_v` could fall below fp16's range).
With FRESH_KV, a request with no cached prefix reads this step's own K/V rows (float,
unquantized) instead of the cache: the same inner loop, its keys addressed row after row.
K and V come with their own strides: they are views of the fused qkv projection, or a
contiguous copy (rotary's or a norm's output), in any mix.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvflow.kernels.kv_codec_triton import FLOAT, decode_codes, load_scale
from kvflow.kernels.launch_utils import round_to


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
def _load_kv(ptrs, mask, KV_CODEC: tl.constexpr):
    """A K or V tile as fp32: the values of a float cache, the codes of a quantized one."""
    if KV_CODEC == FLOAT:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        return decode_codes(tl.load(ptrs, mask=mask, other=0), KV_CODEC)


@triton.jit
def _attend_range(
    acc,  # [BLOCK_M, HEAD_DIM_P] fp32, unnormalised output
    l_i,  # [BLOCK_M] fp32, running sum of exp2
    m_i,  # [BLOCK_M] fp32, running max (log2 domain)
    q,  # [BLOCK_M, HEAD_DIM_P] in DOT_DTYPE
    q_pos,  # [BLOCK_M] int32, absolute position of each row's query token
    k_base,  # kv_cache K plane + kv_head offset (PAGED), or the request's first key row
    v_base,  # kv_cache V plane + kv_head offset (PAGED), or the request's first value row
    block_table_row,  # [max_blocks] int32 of this request (PAGED)
    lo,
    hi,
    qk_scale,
    sliding_window,
    stride_block,
    stride_slot,  # a cache slot (PAGED), else a key row
    stride_v_row,  # a value row (not PAGED; paged values share the keys' slot offsets)
    offs_d,  # [HEAD_DIM_P]
    mask_d,  # [HEAD_DIM_P]
    head_dim,  # where a quantized row's scale bytes start
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PAGED: tl.constexpr,
    KV_CODEC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys lo..hi-1 into (acc, l_i, m_i), TILE_N keys at a time."""
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)  # [TILE_N] context positions
        mask_n = offs_n < hi
        if PAGED:
            # Tiles may straddle pages (and pages need not be powers of two): gather per key.
            page = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
            slot_off = page.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
            v_off = slot_off
        else:  # this step's own rows, one after the other
            slot_off = offs_n.to(tl.int64) * stride_slot
            v_off = offs_n.to(tl.int64) * stride_v_row
        kv_mask = mask_n[None, :] & mask_d[:, None]
        k = _load_kv(k_base + slot_off[None, :] + offs_d[:, None], kv_mask, KV_CODEC)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
        if KV_CODEC == FLOAT:
            s = s * qk_scale
        else:  # k holds codes: each key's scale multiplies its column of scores
            k_scale = load_scale(k_base + slot_off + head_dim, mask_n, KV_CODEC)  # [TILE_N]
            s = s * (qk_scale * k_scale)[None, :]
        allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - offs_n[None, :] < sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        # A row with nothing allowed yet keeps max -inf; shift by 0 so exp2 gives 0, not nan.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)  # [BLOCK_M]
        p = tl.math.exp2(s - m_shift[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_mask = mask_n[:, None] & mask_d[None, :]
        v = _load_kv(v_base + v_off[:, None] + offs_d[None, :], v_mask, KV_CODEC)
        if KV_CODEC != FLOAT:
            v_scale = load_scale(v_base + v_off + head_dim, mask_n, KV_CODEC)  # [TILE_N]
            if DOT_DTYPE == tl.float16:  # noqa: SIM300 (DOT_DTYPE is not a constant)
                # p * s_v may be far below fp16's normal range (e5m2: s_v = amax / 57344);
                # the dequantized values are in the model's own (fp16) range.
                v = v * v_scale[:, None]
            else:  # fold each value row's scale into its weight: TILE_N x BLOCK_M products
                p = p * v_scale[None, :]
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


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
    num_reqs,
    qk_scale,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    FRESH_KV: tl.constexpr,
    KV_CODEC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (query tiles, num_kv_heads, NUM_SPLITS). One split writes the output itself;
    several write fp32 partials for `_split_kv_merge_kernel`."""
    req, q_start, q_len, ctx_len, q_tile = _locate_tile(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, BLOCK_Q=BLOCK_Q
    )
    if q_tile * BLOCK_Q >= q_len:
        return
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok, head_in_group, mask_m, q_pos, lo, hi = _tile_rows(
        q_tile, q_len, ctx_len, sliding_window, BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, GROUP=GROUP
    )
    # Split s takes a whole number of key tiles; trailing splits may get none and then
    # write (max=-inf, sum=0, acc=0), which the merge weighs as nothing.
    per_split = tl.cdiv(tl.cdiv(hi - lo, TILE_N), NUM_SPLITS) * TILE_N
    split_lo = lo + split * per_split
    split_hi = tl.minimum(hi, split_lo + per_split)
    head = kv_head * GROUP + head_in_group  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask_d = offs_d < head_dim
    mask_md = mask_m[:, None] & mask_d[None, :]
    rows = (q_start + tok).to(tl.int64)  # [BLOCK_M]
    q_off = rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_md, other=0.0).to(tl.float32).to(DOT_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    fresh = False
    if FRESH_KV:
        fresh = ctx_len == 0
    if fresh:
        # No cached prefix: the request attends its own K/V as computed, not as stored
        # (quantized), row after row from this step's key/value tensors.
        k_off = q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_off = q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, q_pos, key_ptr + k_off, value_ptr + v_off,
            block_tables_ptr, split_lo, split_hi, qk_scale, sliding_window, 0, stride_kt,
            stride_vt, offs_d, mask_d, head_dim,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, USE_WINDOW=USE_WINDOW, PAGED=False,
            KV_CODEC=FLOAT, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    else:
        kv_base = kv_cache_ptr + kv_head * stride_c_head
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, q_pos, kv_base, kv_base + stride_c_kv,
            block_tables_ptr + req * stride_bt, split_lo, split_hi, qk_scale, sliding_window,
            stride_c_block, stride_c_slot, 0, offs_d, mask_d, head_dim,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, USE_WINDOW=USE_WINDOW, PAGED=True,
            KV_CODEC=KV_CODEC, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
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

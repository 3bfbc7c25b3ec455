"""The inner loop of paged attention: one tile of query rows folded over a range of keys.

`attend_range` is online softmax in fp32 (exp2, with log2(e) folded into the scale),
TILE_N keys at a time, read from the paged cache through a request's block table or,
not PAGED, from this step's own K/V rows one after the other. Both kernels of
paged_attention_kernels.py (unified and split-KV) run it.

A quantized cache (kernels/kv_codec.py: 8-bit codes plus an fp32 scale per (token, KV
head) row) reaches the kernel as bytes, row stride head_dim + 4. Its codes go to the dot
operands unscaled (every int8 / fp8 code is exact in bf16 and fp16), and the per-row
scales are folded in where they cost one multiply per key instead of one per element:
scores are `(q . k_codes) * s_k` per key column, and the softmax weights are multiplied
by `s_v` per key before the P.V dot (the running sum still adds the unscaled weights;
with fp16 operands V is dequantized instead, as `p * s_v` could fall below fp16's range).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvflow.kernels.kv_codec_triton import FLOAT, decode_codes, load_scale


@triton.jit
def _load_kv(ptrs, mask, KV_CODEC: tl.constexpr):
    """A K or V tile as fp32: the values of a float cache, the codes of a quantized one."""
    if KV_CODEC == FLOAT:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        return decode_codes(tl.load(ptrs, mask=mask, other=0), KV_CODEC)


@triton.jit
def _row_offsets(
    offs_n,  # [TILE_N] context positions
    mask_n,  # [TILE_N]
    block_table_row,  # [max_blocks] int32 of this request (PAGED)
    stride_block,
    stride_slot,  # a cache slot (PAGED), else a key row
    stride_v_row,  # a value row (not PAGED; paged values share the keys' slot offsets)
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
):
    """([TILE_N], [TILE_N]) int64 offsets of these keys' K rows from the K base and of
    their V rows from the V base."""
    if PAGED:
        # Tiles may straddle pages (and pages need not be powers of two): gather per key.
        page = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        slot_off = page.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
        return slot_off, slot_off
    else:  # this step's own rows, one after the other
        return offs_n.to(tl.int64) * stride_slot, offs_n.to(tl.int64) * stride_v_row


@triton.jit
def _tile_scores(
    q,  # [BLOCK_M, HEAD_DIM_P] in DOT_DTYPE
    q_pos,  # [BLOCK_M] int32, absolute position of each row's query token
    k_base,
    k_off,  # [TILE_N] int64, from _row_offsets
    offs_n,  # [TILE_N] context positions
    mask_n,  # [TILE_N]
    offs_d,  # [HEAD_DIM_P]
    mask_d,  # [HEAD_DIM_P]
    qk_scale,
    sliding_window,
    head_dim,
    USE_WINDOW: tl.constexpr,
    KV_CODEC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BLOCK_M, TILE_N] fp32 scores times qk_scale, -inf where a query may not see a key."""
    kv_mask = mask_n[None, :] & mask_d[:, None]
    k = _load_kv(k_base + k_off[None, :] + offs_d[:, None], kv_mask, KV_CODEC)
    s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
    if KV_CODEC == FLOAT:
        s = s * qk_scale
    else:  # k holds codes: each key's scale multiplies its column of scores
        k_scale = load_scale(k_base + k_off + head_dim, mask_n, KV_CODEC)  # [TILE_N]
        s = s * (qk_scale * k_scale)[None, :]
    allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        allowed = allowed & (q_pos[:, None] - offs_n[None, :] < sliding_window)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _tile_values(
    p,  # [BLOCK_M, TILE_N] fp32 softmax weights
    v_base,
    v_off,  # [TILE_N] int64, from _row_offsets
    mask_n,  # [TILE_N]
    offs_d,  # [HEAD_DIM_P]
    mask_d,  # [HEAD_DIM_P]
    head_dim,
    KV_CODEC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """p . V of one key tile, [BLOCK_M, HEAD_DIM_P] fp32 (a quantized V's scales applied)."""
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
    return tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)


@triton.jit
def attend_range(
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
    """Fold keys lo..hi-1 into (acc, l_i, m_i), TILE_N keys at a time (online softmax)."""
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)  # [TILE_N] context positions
        mask_n = offs_n < hi
        k_off, v_off = _row_offsets(
            offs_n, mask_n, block_table_row, stride_block, stride_slot, stride_v_row,
            BLOCK_SIZE=BLOCK_SIZE, PAGED=PAGED,
        )  # fmt: skip
        s = _tile_scores(
            q, q_pos, k_base, k_off, offs_n, mask_n, offs_d, mask_d, qk_scale,
            sliding_window, head_dim, USE_WINDOW=USE_WINDOW, KV_CODEC=KV_CODEC,
            DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        # A row with nothing allowed yet keeps max -inf; shift by 0 so exp2 gives 0, not nan.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)  # [BLOCK_M]
        p = tl.math.exp2(s - m_shift[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)  # the weights before any V scale
        pv = _tile_values(
            p, v_base, v_off, mask_n, offs_d, mask_d, head_dim,
            KV_CODEC=KV_CODEC, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i

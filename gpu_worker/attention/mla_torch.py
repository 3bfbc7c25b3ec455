"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in torch ops.

An MLA layer caches one row per token (kv_cache.py's 1-plane layout), `W = r + R` wide:

    latent row  [ c_kv (r = kv_lora_rank) | k_pe (R = qk_rope_head_dim, rotated) ]

and decompresses per head h with kv_b [H, N + V, r] (the checkpoint's kv_b_proj, split
into W_UK = kv_b[:, :N] and W_UV = kv_b[:, N:]):

    k_h = [ W_UK[h] c | k_pe ]   (N + R)        v_h = W_UV[h] c   (V)

Two ways to attend, equal in exact arithmetic (tests/unit/test_mla_attention.py):

* decompressed (prefills): K and V of every context token are expanded from the latent,
  then one SDPA call per prefill over [q_nope | q_pe] of N + R per head. Compute goes
  with the query length, so a long prompt pays the expansion once.
* absorbed (decodes): W_UK is folded into the query, q_h' = [ q_nope_h W_UK[h] | q_pe_h ]
  (W wide), so every head attends the cached rows themselves, as multi-query attention
  with one KV head whose K is the whole row and V its first r dims; the output goes
  through W_UV. Nothing per context token is expanded: a decode reads W values a token.

The step's plan (which rows decode, which prefill, their block tables) is the torch
backend's (torch_backend.py), made once per step and shared with every layer.
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.attention.softcap import attend
from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, N], q_pe [T, H, R], kv_b [H, N + V, r] -> [T, H, r + R]: the query
    that attends latent rows directly (q_nope W_UK per head, then the rope part)."""
    nope = q_nope.shape[-1]
    absorbed = torch.bmm(q_nope.transpose(0, 1), kv_b[:, :nope])  # [H, T, r]
    return torch.cat((absorbed.transpose(0, 1), q_pe), dim=-1)


def expand_output(attended: torch.Tensor, kv_b: torch.Tensor, nope: int) -> torch.Tensor:
    """attended latents [T, H, r] -> values [T, H, V] through W_UV per head."""
    values = torch.bmm(attended.transpose(0, 1), kv_b[:, nope:].transpose(1, 2))  # [H, T, V]
    return values.transpose(0, 1)


def decompress(
    context: torch.Tensor, kv_b: torch.Tensor, nope: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [S, r + R] -> k [S, H, N + R], v [S, H, V] of every head."""
    heads, width, rank = kv_b.shape
    kv = torch.nn.functional.linear(context[:, :rank], kv_b.reshape(heads * width, rank))
    k_nope, v = kv.view(-1, heads, width).split([nope, width - nope], dim=-1)
    k_pe = context[:, None, rank:].expand(-1, heads, -1)
    return torch.cat((k_nope, k_pe), dim=-1), v


def latent_attention(
    plans: TorchAttentionBackend,
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, R], rotated
    latent: torch.Tensor,  # [T, 1, r + R]: this step's rows to cache
    kv_b: torch.Tensor,  # [H, N + V, r]
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, r + R], or empty (unbound)
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, V]; padding rows zero
    plan = plans.plan_for(metadata, kv_cache, q_nope.shape[0])
    width = latent.shape[-1]
    slots = kv_cache[0].view(-1, width) if plan.has_cache else None
    if slots is not None:  # padding rows (slot -1) dropped first
        stored = latent[:, 0] if plan.store_rows is None else latent[plan.store_rows, 0]
        slots.index_copy_(0, plan.store_slots, stored)
    nope = q_nope.shape[-1]
    out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], kv_b.shape[1] - nope)
    decode = plan.decode
    if decode is not None and slots is not None:
        query = absorb_query(q_nope[decode.rows], q_pe[decode.rows], kv_b)
        context = slots.index_select(0, decode.slots(None)).view(decode.num_decodes, -1, width)
        mask = decode.mask(None, query.dtype)
        out[decode.rows] = attend_absorbed(query, context, mask, kv_b, nope, scale)
    for prefill in plan.prefills:
        rows = slice(prefill.start, prefill.end)
        if prefill.block_ids is None:  # no cached prefix: this step's own rows
            context = latent[rows, 0]
        else:
            assert slots is not None
            blocks = kv_cache[0].index_select(0, prefill.block_ids)
            context = blocks.view(-1, width)[: prefill.seq_len]
        query = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
        causal = prefill.mask(None, query.device)
        out[rows] = attend_decompressed(query, context, causal, kv_b, nope, scale)
    return out


def attend_absorbed(
    query: torch.Tensor,  # [B, H, r + R] absorbed queries (absorb_query), one per request
    context: torch.Tensor,  # [B, L, r + R] latent rows of each request's context
    mask: torch.Tensor | None,  # [B, 1, 1, L] additive (0 / -inf), or None: all visible
    kv_b: torch.Tensor,  # [H, N + V, r]
    nope: int,
    scale: float,
) -> torch.Tensor:  # [B, H, V]
    rank = kv_b.shape[2]
    k = context[:, None]  # [B, 1, L, W]: one KV head; the H query heads are its G rows
    attended = attend(query[:, None], k, k[..., :rank], mask, is_causal=False, scale=scale)
    return expand_output(attended[:, 0], kv_b, nope)


def attend_decompressed(
    query: torch.Tensor,  # [q_len, H, N + R]
    context: torch.Tensor,  # [S, r + R] latent rows of the whole context
    mask: torch.Tensor | None,  # [q_len, S] bool, or None: plain causal (q_len == S)
    kv_b: torch.Tensor,  # [H, N + V, r]
    nope: int,
    scale: float,
) -> torch.Tensor:  # [q_len, H, V]
    k, v = decompress(context, kv_b, nope)
    attended = attend(
        query.transpose(0, 1)[None],  # [1, H, q_len, N + R]
        k.transpose(0, 1)[None],  # [1, H, S, N + R]
        v.transpose(0, 1)[None],  # [1, H, S, V]
        mask,
        is_causal=mask is None,
        scale=scale,
    )
    return attended[0].transpose(0, 1)

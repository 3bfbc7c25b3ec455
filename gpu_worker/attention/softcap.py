"""Scaled dot-product attention with optional logit soft-capping (Gemma 2).

Soft-capping squashes every attention logit into (-cap, cap) before the mask and the
softmax: logits = cap * tanh(scale * q.k / cap). torch's SDPA has no such option, so a
capped layer runs the same computation in plain ops (float32 softmax, as transformers'
eager attention does); an uncapped one keeps SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,  # [..., H, q_len, D]
    k: torch.Tensor,  # [..., KH, kv_len, D]
    v: torch.Tensor,  # [..., KH, kv_len, D]
    attn_mask: torch.Tensor | None,  # bool (True = attended) or additive, broadcastable
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:  # [..., H, q_len, D]
    """F.scaled_dot_product_attention's contract, plus `softcap`."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # query head h reads KV head h // group
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # top-left aligned, as SDPA's
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, -torch.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)

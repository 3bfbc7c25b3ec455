"""Scaled dot-product attention with the logit options SDPA lacks: soft-capping
(Gemma 2) and attention sinks (gpt-oss).

Soft-capping squashes every attention logit into (-cap, cap) before the mask and the
softmax: logits = cap * tanh(scale * q.k / cap). A sink is one learned logit per query
head that joins the softmax's denominator and has no value: the weights of the keys sum
to less than 1, by the share the sink takes,

    p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)),   out = sum_j p_j v_j.

torch's SDPA has neither option, so a layer with one runs the same computation in plain
ops (float32 softmax, as transformers' eager attention does); any other keeps SDPA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class LogitOptions(NamedTuple):
    """A layer's options on its attention logits (the backends pass them along)."""

    window: int | None = None  # sliding window (keys p - W < k <= p)
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads] float, this rank's heads


def attend(
    q: torch.Tensor,  # [..., H, q_len, D]
    k: torch.Tensor,  # [..., KH, kv_len, D]
    v: torch.Tensor,  # [..., KH, kv_len, D]
    attn_mask: torch.Tensor | None,  # bool (True = attended) or additive, broadcastable
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,  # broadcastable to [..., H, q_len, 1]
) -> torch.Tensor:  # [..., H, q_len, D]
    """F.scaled_dot_product_attention's contract, plus `softcap` and `sinks`."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # query head h reads KV head h // group
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # top-left aligned, as SDPA's
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, -torch.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # the sink as one more column of the softmax, dropped after it
        sink = sinks.to(torch.float32).expand(*scores.shape[:-1], 1)
        with_sink = torch.cat((scores.to(torch.float32), sink), dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)

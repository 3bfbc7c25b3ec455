"""Rotary position embedding (RoPE) in the neox layout that HF Llama uses.

A head vector x of size D is split in halves (x1 = x[:D/2], x2 = x[D/2:]) and each pair
(x1[i], x2[i]) is rotated by angle pos * inv_freq[i]:

    out = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]

cos/sin are computed once per forward pass for the step's positions (`RotaryEmbedding`)
and shared by every layer. On CPUs `apply_rotary_qk` rotates query and key in place in
one native call (kernels/cpu/elementwise.cpp), on CUDA in one Triton launch
(kernels/rotary.py) for bf16 and fp16; the torch ops here are their reference, bit for
bit (each product rounded to the dtype, as Hugging Face's), and the path everywhere else.
The torch ops took 8-10 kernels a layer: 0.35 ms of a 2.6 ms SmolLM2 decode step on an
H100 (docs/benchmarks.md, "GPU").
With a partial rotary factor (Phi-4-mini) only the first `rotary_dim` dims of each head
rotate and the rest pass through. The frequency schedules live in rope_scaling.py; the
length-dependent ones (dynamic, longrope) take each token's request length from the
step's attention metadata.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from kvflow.gpu_worker.attn_metadata import get_forward_context
from kvflow.gpu_worker.layers.rope_scaling import (
    compute_inv_freq,
    dynamic_ntk_inv_freq,
    longrope_inv_freq,
    rope_parameters,
    rope_type_of,
    rotary_dim_of,
)
from kvflow.kernels.cpu import elementwise

__all__ = ["Rope", "RotaryEmbedding", "apply_rotary", "apply_rotary_qk", "rope_parameters"]


class Rope(NamedTuple):
    cos: torch.Tensor  # [num_tokens, 1, head_dim // 2], activation dtype
    sin: torch.Tensor  # [num_tokens, 1, head_dim // 2]
    # The same tables over the whole head, once per step: [cos | cos] and [-sin | sin],
    # so that each layer's rotation is 4 torch ops instead of 8 (same values bit for bit).
    cos_full: torch.Tensor | None = None  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor | None = None  # [num_tokens, 1, head_dim]


class RotaryEmbedding(nn.Module):
    """Turns the step's positions into (cos, sin) once; `apply_rotary` uses them per layer."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.rope_type = rope_type_of(params)
        self.rotary_dim = rotary_dim_of(head_dim, params)
        self.params = {**params, "rope_theta": float(params.get("rope_theta", 10000.0))}
        self.max_position = max_position
        inv_freq, self.attention_scaling = compute_inv_freq(self.rotary_dim, params, max_position)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_inv_freq: torch.Tensor | None
        long = None
        if self.rope_type == "longrope":
            long = longrope_inv_freq(self.rotary_dim, self.params, long=True)
        self.register_buffer("long_inv_freq", long, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [num_tokens] int64 -> Rope with tables in `dtype`."""
        angles = positions.float()[:, None] * self._token_inv_freq(positions).float()
        return self.tables(angles, dtype)

    def tables(self, angles: torch.Tensor, dtype: torch.dtype) -> Rope:
        """angles [num_tokens, rotary_dim // 2] fp32 -> Rope with tables in `dtype`."""
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if elementwise.applies(cos, sin):  # apply_rotary_qk's native kernel takes halves
            return Rope(cos, sin)
        return with_whole_head_tables(cos, sin)

    def _token_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[1, rotary_dim // 2], or [num_tokens, rotary_dim // 2] for a length-dependent
        schedule (each token by its request's context length)."""
        if self.rope_type == "dynamic":
            seq_lens = token_seq_lens(positions)
            return dynamic_ntk_inv_freq(self.rotary_dim, self.params, self.max_position, seq_lens)
        if self.long_inv_freq is not None:
            long = token_seq_lens(positions) > self.params["original_max_position_embeddings"]
            return torch.where(long[:, None], self.long_inv_freq, self.inv_freq)
        return self.inv_freq[None, :]


def token_seq_lens(positions: torch.Tensor) -> torch.Tensor:
    """[num_tokens]: the context length of each token's request in this step (padding
    rows: the last request's). Device ops only, so a CUDA graph replays them."""
    md = get_forward_context().attn_metadata
    rows = torch.arange(positions.shape[0], device=positions.device, dtype=torch.int32)
    starts = md.query_start_loc[1:].to(torch.int32)
    requests = torch.searchsorted(starts, rows, right=True).clamp_(max=starts.shape[0] - 1)
    return md.seq_lens[requests]


def with_whole_head_tables(cos: torch.Tensor, sin: torch.Tensor) -> Rope:
    """Rope of half tables [num_tokens, 1, head_dim // 2] plus the whole-head ones."""
    return Rope(cos, sin, torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] -> rotated copy, same shape and dtype:
    (x1 cos - x2 sin, x2 cos + x1 sin) for the halves x1, x2 of each head."""
    if rope.cos_full is None or rope.sin_signed is None:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin), dim=-1)
    # x2 * -sin == -(x2 * sin) exactly, so this is the line above to the bit.
    return x * rope.cos_full + x.roll(x.shape[-1] // 2, dims=-1) * rope.sin_signed


def apply_rotary_qk(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    rope: Rope,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(apply_rotary(q), apply_rotary(k)). On CPUs in place, in one native call: q and k
    must then be tensors nobody else reads unrotated (the qkv projection's fresh output).
    With tables narrower than the head (partial rotary) the tail of each head passes."""
    rotary_dim = rope.cos.shape[-1] * 2
    if rotary_dim < q.shape[-1]:
        return _apply_partial(q, rope, rotary_dim), _apply_partial(k, rope, rotary_dim)
    if elementwise.rotary_applies(q, k, rope.cos) and rope.sin.is_contiguous():
        elementwise.rotary_qk(q, k, rope.cos, rope.sin)
        return q, k
    if _triton_applies(q, k, rope):
        from kvflow.kernels.rotary import rotary_embedding_tables  # Triton: never on CPU

        rotary_embedding_tables(q, k, rope.cos.squeeze(1), rope.sin.squeeze(1))
        return q, k
    return apply_rotary(q, rope), apply_rotary(k, rope)


def _triton_applies(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> bool:
    """CUDA, 16-bit (in fp32 the kernel's sums could fuse into an FMA where torch rounds
    the product), heads with contiguous dims, per-token tables of one row a token."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.dtype == k.dtype == rope.cos.dtype == rope.sin.dtype
        and q.dim() == 3
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and rope.cos.shape[0] == q.shape[0]
        and rope.cos.stride(-1) == 1
        and rope.sin.stride(0) == rope.cos.stride(0)
    )


def _apply_partial(x: torch.Tensor, rope: Rope, rotary_dim: int) -> torch.Tensor:
    return torch.cat((apply_rotary(x[..., :rotary_dim], rope), x[..., rotary_dim:]), dim=-1)

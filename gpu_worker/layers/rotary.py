"""Rotary position embedding (RoPE) in the neox layout that HF Llama uses.

A head vector x of size D is split in halves (x1 = x[:D/2], x2 = x[D/2:]) and each pair
(x1[i], x2[i]) is rotated by angle pos * inv_freq[i]:

    out = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]

cos/sin are computed once per forward pass for the step's positions (`RotaryEmbedding`)
and shared by every layer. On CPUs `apply_rotary_qk` rotates query and key in place in
one native call (kernels/cpu/elementwise.cpp); the torch ops here are its reference. The frequency schedules are the static (position-independent)
ones of HF's rope configs: "default", "linear", "llama3" and "yarn"; the dynamic ones
depend on the sequence length and are refused.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from kvflow.kernels.cpu import elementwise


class Rope(NamedTuple):
    cos: torch.Tensor  # [num_tokens, 1, head_dim // 2], activation dtype
    sin: torch.Tensor  # [num_tokens, 1, head_dim // 2]
    # The same tables over the whole head, once per step: [cos | cos] and [-sin | sin],
    # so that each layer's rotation is 4 torch ops instead of 8 (same values bit for bit).
    cos_full: torch.Tensor | None = None  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor | None = None  # [num_tokens, 1, head_dim]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope dict of an HF config: transformers 5 `rope_parameters`, or the older
    `rope_scaling` + `rope_theta` pair."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    merged = dict(getattr(config, "rope_scaling", None) or {})
    merged.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return merged


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)  # [dim // 2]


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention logits."""
    theta = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is high enough to extrapolate unchanged
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def compute_inv_freq(
    head_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling applied to cos/sin)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    theta = float(params.get("rope_theta", 10000.0))
    inv_freq = _default_inv_freq(head_dim, theta)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, {**params, "rope_theta": theta}, max_position)
    raise ValueError(
        f"unsupported rope type {rope_type!r} (supported: default, linear, llama3, yarn)"
    )


class RotaryEmbedding(nn.Module):
    """Turns the step's positions into (cos, sin) once; `apply_rotary` uses them per layer."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(head_dim, params, max_position)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [num_tokens] int64 -> Rope with tables in `dtype`."""
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if elementwise.applies(cos, sin):  # apply_rotary_qk's native kernel takes halves
            return Rope(cos, sin)
        return with_whole_head_tables(cos, sin)


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
    must then be tensors nobody else reads unrotated (the qkv projection's fresh output)."""
    if elementwise.rotary_applies(q, k, rope.cos) and rope.sin.is_contiguous():
        elementwise.rotary_qk(q, k, rope.cos, rope.sin)
        return q, k
    return apply_rotary(q, rope), apply_rotary(k, rope)

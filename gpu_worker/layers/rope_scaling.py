"""RoPE frequency schedules, read from `rope_scaling` / `rope_parameters` as transformers
reads them: default, linear, dynamic (NTK), llama3, yarn and longrope.

Most schedules are static: one inverse-frequency vector for every position. Two depend
on the length of the sequence being run, which transformers takes as the longest
position of the forward pass (max(position_ids) + 1); kvflow takes it per request, as
the request's context length in the step (`seq_len`), so a batch runs each request as
transformers runs it alone:

* dynamic: for seq_len > max_position_embeddings the base grows with seq_len (NTK);
* longrope (Phi-3 "su"/"longrope"): short factors up to original_max_position_embeddings,
  long factors past it.

Keys already in the cache keep the rotation they were stored with, as in transformers'
cached decoding; the one difference: when a Phi-3 request grows past the original
context, transformers' generate re-encodes the whole sequence with the long factors,
whereas kvflow rotates only the new tokens with them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Phi-3's first checkpoints; Qwen2-VL's older configs name M-RoPE's (default) schedule
# "mrope" (its sections are read by layers/mrope.py).
_ALIASES = {"su": "longrope", "mrope": "default"}


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope dict of an HF config: transformers 5 `rope_parameters`, or the older
    `rope_scaling` + `rope_theta` pair (plus the config-level fields schedules read)."""
    params = getattr(config, "rope_parameters", None)
    merged = dict(params) if params else dict(getattr(config, "rope_scaling", None) or {})
    merged.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    for key in ("original_max_position_embeddings", "partial_rotary_factor"):
        value = getattr(config, key, None)
        if value is not None:
            merged.setdefault(key, value)
    return merged


def rope_type_of(params: dict[str, Any]) -> str:
    """The schedule's name; an unknown one is refused here, at model construction."""
    name = params.get("rope_type", params.get("type", "default"))
    name = _ALIASES.get(name, name)
    if name not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {name!r} (supported: {', '.join(ROPE_TYPES)})")
    return str(name)


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dims of each head rotate (Phi-4-mini: 3/4 of them)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def default_inv_freq(dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    """[dim // 2] float32, or [T, dim // 2] for a per-token `theta` [T, 1]."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


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


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_mscale(params: dict[str, Any]) -> float:
    """DeepSeek's factor on the attention softmax scale: with a scaled rope and
    `mscale_all_dim`, mscale(factor, mscale_all_dim)^2 (the cos/sin tables carry
    mscale / mscale_all_dim, `compute_inv_freq`'s attention scaling, on top)."""
    m_all = params.get("mscale_all_dim")
    if rope_type_of(params) == "default" or not m_all:
        return 1.0
    return yarn_mscale(params["factor"], m_all) ** 2


def _yarn_inv_freq(
    dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention logits."""
    theta = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
            if m and m_all
            else yarn_mscale(factor)
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


def longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return float(attention_factor)


def longrope_inv_freq(dim: int, params: dict[str, Any], long: bool) -> torch.Tensor:
    """LongRoPE's [dim // 2] frequencies with the short or the long factors."""
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ValueError(f"longrope factors have {factors.numel()} entries, expected {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * float(params["rope_theta"]) ** shape)


def dynamic_ntk_inv_freq(
    dim: int, params: dict[str, Any], max_position: int, seq_lens: torch.Tensor
) -> torch.Tensor:
    """[T, dim // 2]: each token's frequencies for its request's length `seq_lens` [T]."""
    factor = params["factor"]
    length = seq_lens.float().clamp(min=max_position)[:, None]
    base = params["rope_theta"] * ((factor * length / max_position) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    return default_inv_freq(dim, base)


def compute_inv_freq(
    dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2] float32, attention scaling applied to cos/sin) of a static
    schedule; for a length-dependent one, those of its short sequences."""
    rope_type = rope_type_of(params)
    theta = float(params.get("rope_theta", 10000.0))
    inv_freq = default_inv_freq(dim, theta)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, {**params, "rope_theta": theta}, max_position)
    params = {**params, "rope_theta": theta}
    return longrope_inv_freq(dim, params, long=False), longrope_attention_factor(
        params, max_position
    )

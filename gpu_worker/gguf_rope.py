"""Llama 3.1's RoPE schedule recovered from a GGUF's `rope_freqs` tensor.

llama.cpp's converter does not store Llama 3.1's `rope_scaling` (factor, low/high
frequency factors, original context); it stores the schedule's result, one divisor per
rotary frequency (`rope_freqs.weight`, [head_dim / 2]): 1 for short wavelengths, `factor`
for long ones, and on the ramp between

    1 / f = (1 - s) / factor + s,    s = (original / wavelength - low) / (high - low)

s is linear in 1 / wavelength, so two ramp points give its slope A = original / (high -
low) and intercept B = -low / (high - low); the ramp's ends, original / high and
original / low, follow from A and B alone, so every (original, low, high) with those
A and B is the same schedule. We take low = 1 (the releases' value), hence
high = 1 - 1 / B and original = -A / B, and accept the result only if kvflow's own
llama3 schedule (layers/rope_scaling.py) reproduces every divisor of the tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.layers.rope_scaling import compute_inv_freq, default_inv_freq

ROPE_FREQS = "rope_freqs.weight"


def _refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"GGUF {ROPE_FREQS} is not a Llama 3.1 RoPE schedule: {why}")


def _tidy(value: float, digits: int) -> float:
    """`value` rounded to `digits` where the fit's float32 noise is all that differs
    (the releases' 4.0 and 8192); the check below holds either way."""
    rounded = round(value, digits)
    return rounded if abs(value - rounded) <= 1e-5 * abs(value) else value


def llama3_rope(divisors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """rope_parameters (type llama3) whose schedule divides the frequencies by `divisors`."""
    inv_freq = default_inv_freq(head_dim, theta).double().numpy()
    if divisors.shape != inv_freq.shape:
        raise _refuse(f"{divisors.size} values for {inv_freq.size} rotary frequencies")
    factor = float(divisors.max())
    ramp = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if ramp.sum() < 2 or factor <= 1:
        raise _refuse("fewer than two frequencies on the ramp between 1 and the factor")
    smooth = (1 / divisors[ramp] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[ramp] / (2 * math.pi), smooth, 1)  # 1 / wavelength
    if intercept >= 0:
        raise _refuse("its ramp does not start at a positive low-frequency factor")
    original = _tidy(float(-slope / intercept), 0)
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": _tidy(float(1 - 1 / intercept), 4),
        "original_max_position_embeddings": int(original) if original.is_integer() else original,
    }
    scheduled, _ = compute_inv_freq(head_dim, params, max_position=0)
    expected = default_inv_freq(head_dim, theta) / torch.from_numpy(divisors).float()
    if not torch.allclose(scheduled, expected, rtol=1e-5, atol=0):
        raise _refuse("kvflow's llama3 schedule does not reproduce it")
    return params

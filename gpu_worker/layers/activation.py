"""Gated activation of the Llama MLP, fused: natively on CPUs (kernels/cpu/elementwise.cpp),
in Triton on CUDA (kernels/activation.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.cpu import elementwise


class SiluAndMul(nn.Module):
    """[..., 2 * d] laid out as gate|up (MergedColumnParallelLinear) -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise.applies(x):
            return elementwise.silu_and_mul(x)
        if x.is_cuda and x.dim() == 2:
            from kvflow.kernels.activation import silu_and_mul  # Triton: never imported on CPU

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

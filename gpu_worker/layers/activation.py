"""Gated activations of the MLP: the Llama one (SiLU), fused natively on CPUs
(kernels/cpu/elementwise.cpp) and in Triton on CUDA (kernels/activation.py), and Gemma's
tanh-approximated GELU (`gelu_pytorch_tanh`) in torch ops."""

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


class GeluTanhAndMul(nn.Module):
    """[..., 2 * d] laid out as gate|up -> gelu_tanh(gate) * up, [..., d] (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """The gate|up activation of HF's `hidden_act` / `hidden_activation` name."""
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"unsupported MLP activation {name!r} (supported: silu, gelu_pytorch_tanh)")

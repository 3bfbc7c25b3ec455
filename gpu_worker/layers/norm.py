"""RMSNorm, with the residual add fused in (pre-norm decoder blocks).

Numerics follow Hugging Face's LlamaRMSNorm so fp32 and bf16 logits match it: the
variance is taken in float32, the normalised value is cast back to the input dtype and
only then scaled by the weight; the residual add happens in the activation dtype. On
CPUs the fused native kernel (kernels/cpu/elementwise.cpp) does the same in one pass;
these torch ops are its reference and the path everywhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.gpu_worker.layers.linear import copy_checked_loader, new_parameter
from kvflow.kernels.cpu import elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), copy_checked_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., hidden], normalised over the last dim."""
        if elementwise.applies(x, self.weight):
            return elementwise.rms_norm(x, self.weight, self.eps)[0]
        return self._norm(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the new residual stream is returned too."""
        if elementwise.applies(x, residual, self.weight):
            normed, summed = elementwise.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return normed, summed
        residual = x + residual
        return self._norm(residual), residual

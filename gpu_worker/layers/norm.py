"""RMSNorm, with the residual add fused in (pre-norm decoder blocks).

Numerics follow Hugging Face's LlamaRMSNorm so fp32 and bf16 logits match it: the
variance is taken in float32, the normalised value is cast back to the input dtype and
only then scaled by the weight; the residual add happens in the activation dtype. On
CPUs the fused native kernel (kernels/cpu/elementwise.cpp) and on CUDA the Triton kernel
(kernels/rms_norm.py) do the same in one pass; these torch ops are their reference and
the path everywhere else.
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
        if _triton_applies(x):
            from kvflow.kernels.rms_norm import rms_norm  # Triton: never imported on CPU

            return rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the new residual stream is returned too."""
        if elementwise.applies(x, residual, self.weight):
            normed, summed = elementwise.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return normed, summed
        if _triton_applies(x):
            from kvflow.kernels.rms_norm import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self._norm(residual), residual


def _triton_applies(x: torch.Tensor) -> bool:
    """The Triton kernel takes [num_tokens, hidden] rows on CUDA (per-head norms are 3-D)."""
    return x.is_cuda and x.dim() == 2

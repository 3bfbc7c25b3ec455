"""RMSNorm, with the residual add fused in (pre-norm decoder blocks), and Gemma's variant.

Numerics follow Hugging Face's LlamaRMSNorm so fp32 and bf16 logits match it: the
variance is taken in float32, the normalised value is cast back to the input dtype and
only then scaled by the weight; the residual add happens in the activation dtype. On
CPUs the fused native kernel (kernels/cpu/elementwise.cpp) and on CUDA the Triton kernel
(kernels/rms_norm.py) do the same in one pass; these torch ops are their reference and
the path everywhere else.

Gemma's RMSNorm (`unit_offset=True`) scales by (1 + weight) and keeps the whole
computation in float32 before casting back (its checkpoints store weight around 0). The
native kernels scale after the cast, so that variant always takes the torch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.gpu_worker.layers.linear import copy_checked, copy_checked_loader, new_parameter
from kvflow.gpu_worker.parallel_state import get_tp_group
from kvflow.kernels.cpu import elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = new_parameter((hidden_size,), copy_checked_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., hidden], normalised over the last dim."""
        if self.unit_offset:
            return self._norm(x)
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
        if self.unit_offset:
            residual = x + residual
            return self._norm(residual), residual
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


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features that tensor parallelism splits (OLMo 2's q/k norms span the
    whole projection): a rank holds features [start, start + size) of the checkpoint's
    weight and all-reduces the squares' sum. Ranks that replicate a KV head count it
    once each, in the sum and in the divisor alike, so the mean is exact."""

    def __init__(self, eps: float, total: int, start: int, size: int) -> None:
        super().__init__()
        self.eps, self.total, self.start, self.size = eps, total, start, size
        self.tp = get_tp_group()
        self.weight = new_parameter((size,), self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        fits = loaded.shape == (self.total,)
        copy_checked(param.data, loaded.narrow(0, self.start, self.size) if fits else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, size] -> [T, size], normalised over the features of every rank."""
        x32 = x.float()
        squares = x32.pow(2).sum(dim=-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        variance = squares / (self.size * self.tp.size)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

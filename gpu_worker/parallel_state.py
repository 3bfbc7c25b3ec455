"""The tensor-parallel group a layer belongs to, and its collectives.

Layers read the group once, at construction (`get_tp_group()`), and keep it; the
forward pass therefore never consults module state. A worker process builds its model
inside `tensor_parallel(size, rank, group)`; outside it the group is the trivial one
(size 1, rank 0) whose collectives are no-ops, so single-process code needs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Tensor-parallel ranks sharing one model; `group=None` means the default group."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        assert self.size >= 1 and 0 <= self.rank < self.size, (self.size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_tp_group = TPGroup()


@contextmanager
def tensor_parallel(
    size: int, rank: int, group: dist.ProcessGroup | None = None
) -> Iterator[TPGroup]:
    """Make (size, rank, group) the group that layers built inside the block join."""
    global _tp_group
    previous = _tp_group
    _tp_group = TPGroup(size, rank, group)
    try:
        yield _tp_group
    finally:
        _tp_group = previous


def get_tp_group() -> TPGroup:
    return _tp_group


def divide(numerator: int, denominator: int) -> int:
    """Exact division; a shape that does not split evenly across ranks is a config error."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator

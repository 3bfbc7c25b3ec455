"""The tensor-parallel group a layer belongs to, and the pipeline stage a model is.

Layers read the group once, at construction (`get_tp_group()`), and keep it; the
forward pass therefore never consults module state. A worker process builds its model
inside `tensor_parallel(size, rank, group)`; outside it the group is the trivial one
(size 1, rank 0) whose collectives are no-ops, so single-process code needs nothing.

Pipeline parallelism the same way: a model built inside `pipeline_parallel(stage)`
builds only that stage's layers (`PPGroup.layer_range`). Ranks are laid out stage-major,
rank = stage * T + tp_rank, so a stage's TP ranks are consecutive and rank (s, t) hands
its activations to (s + 1, t)::

    T=2, P=2:   stage 0: ranks 0 1  ──send──▶  stage 1: ranks 2 3
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvflow.errors import ConfigError


@dataclass(frozen=True)
class TPGroup:
    """Tensor-parallel ranks sharing one model; `group=None` means the default group.
    `expert_parallel`: a mixture-of-experts layer gives each rank whole experts instead
    of a slice of every expert (gpu_worker/layers/moe.py)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False

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
    size: int, rank: int, group: dist.ProcessGroup | None = None, expert_parallel: bool = False
) -> Iterator[TPGroup]:
    """Make (size, rank, group) the group that layers built inside the block join."""
    global _tp_group
    previous = _tp_group
    _tp_group = TPGroup(size, rank, group, expert_parallel)
    try:
        yield _tp_group
    finally:
        _tp_group = previous


def get_tp_group() -> TPGroup:
    return _tp_group


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage: its layers and its neighbours (global ranks).

    `group` carries the stage-to-stage sends (every rank, the step timeout); `None` with
    one stage. `layer_partition` overrides the even split (layers per stage)."""

    size: int = 1
    stage: int = 0
    prev_rank: int | None = None
    next_rank: int | None = None
    group: dist.ProcessGroup | None = None
    layer_partition: tuple[int, ...] | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        assert self.size >= 1 and 0 <= self.stage < self.size, (self.size, self.stage)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int, head_cost: float = 0.0) -> tuple[int, int]:
        """[start, end) of the global layer indexes this stage holds (`head_cost`: the
        last stage's LM head, in decoder layers' worth of weights)."""
        counts = partition_layers(num_layers, self.size, self.layer_partition, head_cost)
        start = sum(counts[: self.stage])
        return start, start + counts[self.stage]


def partition_layers(
    num_layers: int,
    num_stages: int,
    partition: tuple[int, ...] | None = None,
    head_cost: float = 0.0,
) -> list[int]:
    """Layers per stage: `partition` checked, else a split that balances the stages'
    weights, counting the last stage's LM head as `head_cost` layers.

    At decode a stage's step time follows the weights it reads, and the slowest stage
    sets the pipeline's pace: an LM head is worth 8 layers of SmolLM2-135M (a 49152 x
    576 matrix against 3.5 M weights per layer) and ~2.4 of an 8B Llama, so an even
    split leaves the first stages idle. The first stages take any remainder (they also
    embed, which is a gather: free)."""
    if partition is not None:
        if len(partition) != num_stages or sum(partition) != num_layers or min(partition) < 1:
            raise ConfigError(
                f"pp_layer_partition {','.join(map(str, partition))} must give each of the "
                f"{num_stages} stages >= 1 layer and sum to the model's {num_layers} layers"
            )
        return list(partition)
    if num_layers < num_stages:
        raise ConfigError(
            f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers"
        )
    if num_stages == 1:
        return [num_layers]
    best: list[int] = []
    best_key = (float("inf"), 0.0)
    for last in range(1, num_layers - num_stages + 2):  # ties: the fewest on the last
        counts = [*_even_split(num_layers - last, num_stages - 1), last]
        costs = [*counts[:-1], last + head_cost]
        key = (max(costs), -min(costs))  # the slowest stage, then the least idle one
        if key < best_key:
            best, best_key = counts, key
    return best


def _even_split(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


_pp_group = PPGroup()


@contextmanager
def pipeline_parallel(group: PPGroup) -> Iterator[PPGroup]:
    """Make `group` the pipeline stage that models built inside the block are."""
    global _pp_group
    previous = _pp_group
    _pp_group = group
    try:
        yield group
    finally:
        _pp_group = previous


def get_pp_group() -> PPGroup:
    return _pp_group


def divide(numerator: int, denominator: int) -> int:
    """Exact division; a shape that does not split evenly across ranks is a config error."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator

"""One worker rank's place in a tensor-parallel group: rendezvous, threads, agreement.

    launcher ── RankInit(tcp://host:port, world_size, rank) ──▶ worker rank r
    worker:  init_process_group (gloo on CPU, NCCL on CUDA) at that address
             └─ tensor_parallel(world_size, r): layers built inside it take their shard
             └─ min_over_ranks(num_blocks): every rank sizes its KV cache alike

The rendezvous is TCP (torch's TCPStore, served by rank 0 at the address), so the same
code spans containers and hosts. Every collective of a step waits at most `timeout_s`,
the rendezvous and the start-up agreement at most `startup_timeout_s` (ranks finish
loading at their own pace): a rank that hangs turns into an error on its peers instead
of a stalled engine. A rank that *dies* is noticed sooner: its peers' sockets close,
and the launcher sees the process exit.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvflow.gpu_worker.parallel_state import TPGroup, get_tp_group, tensor_parallel

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # a step's collectives
STARTUP_TIMEOUT_S = 600.0  # the rendezvous and start-up agreement: ranks load at their pace


@dataclass(frozen=True)
class RankInit:
    """What a worker needs to join its group (picklable: it crosses a spawn)."""

    init_method: str  # tcp://host:port where rank 0 serves the rendezvous store
    world_size: int
    rank: int
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    startup_timeout_s: float = STARTUP_TIMEOUT_S


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A tcp:// address on a port free right now (the OS picks it; rank 0 binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def rank_inits(world_size: int, host: str = "127.0.0.1") -> list[RankInit | None]:
    """One entry per rank: None for a single rank (no process group at all)."""
    if world_size == 1:
        return [None]
    address = free_tcp_address(host)
    return [RankInit(address, world_size, rank) for rank in range(world_size)]


def threads_per_rank(world_size: int, requested: int | None) -> int | None:
    """Torch CPU threads of one rank: `--num-threads` as given, else the cores this
    process may use split evenly, so that ranks on one host do not oversubscribe it."""
    if requested is not None or world_size == 1:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


@contextmanager
def rank_group(init: RankInit | None, device: str) -> Iterator[TPGroup]:
    """Join the process group and make it the tensor-parallel group of layers built
    inside; leaves the group on exit. With `init=None`, the trivial group."""
    if init is None:
        yield get_tp_group()
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(init.rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init.init_method,
        rank=init.rank,
        world_size=init.world_size,
        timeout=timedelta(seconds=init.startup_timeout_s),
    )
    logger.info(
        "rank %d of %d joined %s (%s)", init.rank, init.world_size, init.init_method, backend
    )
    try:
        # The layers' collectives run on a group of their own with the short timeout;
        # the default group (long timeout) serves start-up, when ranks finish loading
        # their shards at different times.
        steps = dist.new_group(
            list(range(init.world_size)), timeout=timedelta(seconds=init.timeout_s)
        )
        with tensor_parallel(init.world_size, init.rank, steps) as group:
            yield group
    finally:
        dist.destroy_process_group()


def min_over_ranks(value: int, group: TPGroup, device: str) -> int:
    """The smallest `value` of any rank (the most constrained rank sizes the KV cache)."""
    if group.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)  # start-up: the default group's timeout
    return int(tensor.item())

"""One worker rank's place in its groups: rendezvous, threads, agreement.

    launcher ── RankInit(tcp://host:port, world_size, rank) ──▶ worker rank r
    worker:  init_process_group (gloo on CPU, NCCL on CUDA) at that address
             └─ tensor_parallel(T, r % T): layers built inside it take their shard
             └─ pipeline_parallel(stage r // T): the model built is that stage's layers
             └─ min_over_ranks(num_blocks): every rank sizes its KV cache alike

With P pipeline stages of T ranks each, world size T x P, a stage's ranks form its own
tensor-parallel group (`new_group`), and one more group of every rank carries the
stage-to-stage sends (gpu_worker/stage_link.py), with the step timeout.

The rendezvous is TCP (torch's TCPStore, served by rank 0 at the address), so the same
code spans containers and hosts. The store cannot be authenticated (any peer that
reaches it can read and write keys), so rank 0 listens only on the address's own
interface (the one its host name resolves to), never on every interface as torch's
default would: keep that interface on the cluster's private network. Every collective of a step waits at most `timeout_s`,
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

from kvflow.gpu_worker.parallel_state import (
    PPGroup,
    TPGroup,
    get_tp_group,
    pipeline_parallel,
    tensor_parallel,
)

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
    pipeline_parallel_size: int = 1  # stages; tensor-parallel size = world_size / this
    layer_partition: tuple[int, ...] | None = None  # layers per stage (None: even)
    expert_parallel: bool = False  # whole experts per TP rank (gpu_worker/layers/moe.py)

    @property
    def tensor_parallel_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A tcp:// address on a port free right now (the OS picks it; rank 0 binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def rank_inits(
    world_size: int,
    host: str = "127.0.0.1",
    pipeline_parallel_size: int = 1,
    layer_partition: tuple[int, ...] | None = None,
    expert_parallel: bool = False,
) -> list[RankInit | None]:
    """One entry per rank: None for a single rank (no process group at all)."""
    if world_size == 1:
        return [None]
    address = free_tcp_address(host)
    return [
        RankInit(
            address,
            world_size,
            rank,
            pipeline_parallel_size=pipeline_parallel_size,
            layer_partition=layer_partition,
            expert_parallel=expert_parallel,
        )
        for rank in range(world_size)
    ]


def rendezvous_store(init: RankInit) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it on the init address's interface only (a
    socket it binds itself, handed to torch), the others connect to it."""
    host, port = init.init_method.removeprefix("tcp://").rsplit(":", 1)
    host = host.strip("[]")
    timeout = timedelta(seconds=init.startup_timeout_s)
    if init.rank != 0:
        return dist.TCPStore(host, int(port), init.world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))  # a host name binds the address it resolves to
    listener.listen(init.world_size * 4)
    store = dist.TCPStore(
        host,
        int(port),
        init.world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from here
    )
    return store


def threads_per_rank(world_size: int, requested: int | None) -> int | None:
    """Torch CPU threads of one rank: `--num-threads` as given, else the cores this
    process may use split evenly, so that ranks on one host do not oversubscribe it."""
    if requested is not None or world_size == 1:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


@contextmanager
def rank_group(init: RankInit | None, device: str) -> Iterator[TPGroup]:
    """Join the process group, and make this rank's tensor-parallel group and pipeline
    stage those of models built inside; leaves the group on exit. With `init=None`,
    the trivial groups."""
    if init is None:
        yield get_tp_group()
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(init.rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        store=rendezvous_store(init),
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
        tp = tensor_parallel(*_stage_tp_group(init), expert_parallel=init.expert_parallel)
        with tp as group, pipeline_parallel(_pp_group(init)):
            yield group
    finally:
        dist.destroy_process_group()


def _stage_tp_group(init: RankInit) -> tuple[int, int, dist.ProcessGroup]:
    """(size, rank, group) of this rank's stage's tensor-parallel group. Every rank
    creates every stage's group (new_group is collective), in stage order."""
    size = init.tensor_parallel_size
    timeout = timedelta(seconds=init.timeout_s)
    groups = [
        dist.new_group(list(range(stage * size, (stage + 1) * size)), timeout=timeout)
        for stage in range(init.pipeline_parallel_size)
    ]
    stage, tp_rank = divmod(init.rank, size)
    return size, tp_rank, groups[stage]


def _pp_group(init: RankInit) -> PPGroup:
    """This rank's stage; its neighbours are the same tensor-parallel rank one stage
    before and after (rank +- T)."""
    stages = init.pipeline_parallel_size
    if stages == 1:
        return PPGroup()
    size = init.tensor_parallel_size
    stage = init.rank // size
    group = dist.new_group(list(range(init.world_size)), timeout=timedelta(seconds=init.timeout_s))
    return PPGroup(
        size=stages,
        stage=stage,
        prev_rank=init.rank - size if stage > 0 else None,
        next_rank=init.rank + size if stage < stages - 1 else None,
        group=group,
        layer_partition=init.layer_partition,
        timeout_s=init.timeout_s,
    )


def min_over_ranks(value: int, group: TPGroup, device: str) -> int:
    """The smallest `value` of any rank of the world (the most constrained rank, of any
    stage, sizes the KV cache)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)  # start-up: the default group's timeout
    return int(tensor.item())

"""The worker ranks of one engine: what each is started with, and how they may fail.

    ranks = worker_rank_args(config, addresses, model_dir)   # one tuple per rank
    children.start("worker", r, run_worker, *ranks[r])       # (launcher, data parallel)

With tensor parallelism (world size T > 1) every rank gets the same rendezvous address
(`RankInit`, gpu_worker/distributed.py) and its own rank. The step plan reaches every
rank on the scheduler's PUB socket (one message, T subscribers: no broadcast hop through
rank 0), every rank runs it, and only rank 0 answers.

A rank cannot be restarted alone: its peers' process group is broken once it is gone.
So with T > 1 a dead rank ends the engine at once (`restart_policy`): the frontend
fails what is in flight, /health answers 503, and the launcher stops every process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.config import EngineConfig, ParallelConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.distributed import rank_inits
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.children import RestartPolicy


def check_parallelism(parallel: ParallelConfig) -> None:
    """Refuse what is not built: pipeline parallelism (tensor parallelism runs)."""
    if parallel.tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {parallel.tensor_parallel_size}")
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "pipeline parallelism is not available yet: pipeline_parallel_size must be 1 "
            "(tensor_parallel_size > 1 is supported)"
        )


def worker_rank_args(
    config: EngineConfig, addresses: ServiceAddresses, model_dir: Path
) -> list[tuple[Any, ...]]:
    """`run_worker`'s positional arguments for each rank, in rank order."""
    inits = rank_inits(config.parallel.world_size)
    return [(config, addresses, rank, model_dir, init) for rank, init in enumerate(inits)]


def restart_policy(config: EngineConfig, policy: RestartPolicy) -> RestartPolicy:
    """`policy` for a single rank; no restarts for a group (see the module docstring)."""
    if config.parallel.world_size == 1:
        return policy
    return replace(policy, max_worker_restarts=0)

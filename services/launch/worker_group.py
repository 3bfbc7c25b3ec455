"""The worker ranks of one engine: what each is started with, and how they may fail.

    ranks = worker_rank_args(config, addresses, model_dir)   # one tuple per rank
    children.start("worker", r, run_worker, *ranks[r])       # (launcher, data parallel)

With tensor and pipeline parallelism (world size T x P > 1) every rank gets the same
rendezvous address (`RankInit`, gpu_worker/distributed.py) and its own rank (stage-major:
rank = stage * T + tp_rank). The step plan reaches every rank on the scheduler's PUB
socket (one message, T x P subscribers: no broadcast hop through rank 0), every rank
runs it (a stage its own layers), and only TP rank 0 of the last stage answers.

A rank cannot be restarted alone: its peers' process group is broken once it is gone.
So with T > 1 a dead rank ends the engine at once (`restart_policy`): the frontend
fails what is in flight, /health answers 503, and the launcher stops every process.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.config import EngineConfig, ParallelConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.distributed import rank_inits
from kvflow.gpu_worker.parallel_state import partition_layers
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.launch.children import RestartPolicy


def check_parallelism(config: EngineConfig) -> None:
    """Refuse what is not built: speculative decoding across pipeline stages."""
    parallel = config.parallel
    if parallel.tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {parallel.tensor_parallel_size}")
    if parallel.pipeline_parallel_size < 1:
        raise ConfigError(
            f"pipeline_parallel_size must be >= 1, got {parallel.pipeline_parallel_size}"
        )
    if parallel.pipeline_parallel_size > 1 and config.speculative.speculative_config is not None:
        raise ConfigError(
            "speculative decoding does not run with pipeline_parallel_size > 1 yet "
            "(drafts need every token known; a stage before the last never samples)"
        )


def check_layer_partition(parallel: ParallelConfig, model_dir: Path) -> None:
    """Before any process starts: the model's layers split over the stages as asked."""
    if parallel.pipeline_parallel_size == 1:
        return
    raw = json.loads((model_dir / "config.json").read_text())
    num_layers = raw.get("num_hidden_layers") or raw.get("text_config", {}).get("num_hidden_layers")
    if isinstance(num_layers, int):
        partition_layers(num_layers, parallel.pipeline_parallel_size, parallel.layer_partition)


def worker_rank_args(
    config: EngineConfig, addresses: ServiceAddresses, model_dir: Path
) -> list[tuple[Any, ...]]:
    """`run_worker`'s positional arguments for each rank, in rank order."""
    parallel = config.parallel
    inits = rank_inits(
        parallel.world_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        layer_partition=parallel.layer_partition,
    )
    return [(config, addresses, rank, model_dir, init) for rank, init in enumerate(inits)]


def restart_policy(config: EngineConfig, policy: RestartPolicy) -> RestartPolicy:
    """`policy` for a single rank; no restarts for a group (see the module docstring)."""
    if config.parallel.world_size == 1:
        return policy
    return replace(policy, max_worker_restarts=0)

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


def check_model_split(parallel: ParallelConfig, model_dir: Path) -> None:
    """Before any process starts: the model splits over the ranks as asked (layers over
    the stages, heads and MLP over the tensor-parallel ranks). `LLM` and `kvflow serve`
    both call this, so a bad size is a ConfigError, not a rank that fails to start."""
    check_layer_partition(parallel, model_dir)
    check_tensor_split(parallel, model_dir)


def check_tensor_split(parallel: ParallelConfig, model_dir: Path) -> None:
    """Each rank holds heads/T query heads, KV heads/T KV heads (or one KV head shared by
    T/KV heads ranks) and intermediate/T MLP columns: all must split evenly."""
    size = parallel.tensor_parallel_size
    if size == 1:
        return
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int):
        return  # a config this rule cannot read: the model's own loader decides
    kv_heads = int(text.get("num_key_value_heads") or heads)
    intermediate = text.get("intermediate_size")
    if tensor_split_fits(size, heads, kv_heads, intermediate):
        return
    fits = [t for t in range(1, heads + 1) if tensor_split_fits(t, heads, kv_heads, intermediate)]
    mlp = f", its {intermediate} MLP columns" if isinstance(intermediate, int) else ""
    raise ConfigError(
        f"tensor_parallel_size={size} must divide the model's {heads} attention heads"
        f"{mlp} and its {kv_heads} KV heads (or be a multiple of them); "
        f"sizes that fit: {', '.join(map(str, fits))}"
    )


def tensor_split_fits(size: int, heads: int, kv_heads: int, intermediate: Any) -> bool:
    """gpu_worker/layers/linear.py's split rule (QKVParallelLinear, the MLP's columns)."""
    kv_fits = kv_heads % size == 0 if kv_heads >= size else size % kv_heads == 0
    mlp_fits = not isinstance(intermediate, int) or intermediate % size == 0
    return heads % size == 0 and kv_fits and mlp_fits


def worker_rank_args(
    config: EngineConfig, addresses: ServiceAddresses, model_dir: Path
) -> list[tuple[Any, ...]]:
    """`run_worker`'s positional arguments for each rank, in rank order."""
    parallel = config.parallel
    inits = rank_inits(
        parallel.world_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        layer_partition=parallel.layer_partition,
        expert_parallel=parallel.enable_expert_parallel,
    )
    return [(config, addresses, rank, model_dir, init) for rank, init in enumerate(inits)]


def restart_policy(config: EngineConfig, policy: RestartPolicy) -> RestartPolicy:
    """`policy` for a single rank; no restarts for a group (see the module docstring)."""
    if config.parallel.world_size == 1:
        return policy
    return replace(policy, max_worker_restarts=0)

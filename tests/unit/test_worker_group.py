"""The worker ranks' start-up arguments, thread split and failure policy (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.config import EngineConfig, ParallelConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.distributed import RankInit, rank_inits, threads_per_rank
from kvflow.gpu_worker.parallel_state import PPGroup, partition_layers
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.launch.children import RestartPolicy
from kvflow.services.launch.worker_group import (
    check_layer_partition,
    check_model_split,
    check_parallelism,
    check_tensor_split,
    restart_policy,
    worker_rank_args,
)


def test_one_rank_joins_no_group() -> None:
    assert rank_inits(1) == [None]


def test_ranks_share_one_tcp_rendezvous() -> None:
    inits = rank_inits(3)
    assert [i.rank for i in inits if i] == [0, 1, 2]
    addresses = {i.init_method for i in inits if i}
    assert len(addresses) == 1
    (address,) = addresses
    assert address.startswith("tcp://127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
    assert all(i is not None and i.world_size == 3 and i.timeout_s > 0 for i in inits)


def test_threads_split_the_cores_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert threads_per_rank(2, None) == 4
    assert threads_per_rank(3, None) == 2
    assert threads_per_rank(16, None) == 1  # never zero
    assert threads_per_rank(2, 3) == 3  # --num-threads is per rank
    assert threads_per_rank(1, None) is None  # one rank: torch's own default


def test_speculative_decoding_with_stages_is_refused_bad_sizes_too() -> None:
    check_parallelism(EngineConfig.create(device="cpu", tensor_parallel_size=4))
    check_parallelism(EngineConfig.create(device="cpu", pipeline_parallel_size=2))
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    with pytest.raises(ConfigError, match="speculative decoding"):
        check_parallelism(
            EngineConfig.create(device="cpu", pipeline_parallel_size=2, speculative_config=spec)
        )
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        check_parallelism(EngineConfig.create(device="cpu", tensor_parallel_size=0))
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        ParallelConfig(pipeline_parallel_size=0)


def test_layer_partition_is_parsed_and_checked(tmp_path: Path) -> None:
    assert ParallelConfig(pipeline_parallel_size=2, pp_layer_partition="1,2").layer_partition == (
        1,
        2,
    )
    as_list = ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=[2, 1])  # type: ignore[arg-type]
    assert as_list.pp_layer_partition == "2,1" and as_list.layer_partition == (2, 1)
    for bad in ("1,x", "0,3", ""):
        with pytest.raises(ConfigError, match="pp_layer_partition"):
            ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=bad)
    with pytest.raises(ConfigError, match="names 3 stages"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition="1,1,1")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    check_layer_partition(ParallelConfig(pipeline_parallel_size=2), tmp_path)
    with pytest.raises(ConfigError, match="sum to the model's 3 layers"):
        check_layer_partition(
            ParallelConfig(pipeline_parallel_size=2, pp_layer_partition="2,2"), tmp_path
        )
    with pytest.raises(ConfigError, match="exceeds the model's 3 layers"):
        check_layer_partition(ParallelConfig(pipeline_parallel_size=4), tmp_path)


def test_the_split_balances_the_lm_head_against_layers() -> None:
    """The last stage's head counts as layers: SmolLM2-135M's is worth 8 of them, so
    two stages get 19 + 11 layers (both ~19 layers of weights), three 13 + 13 + 4."""
    assert partition_layers(30, 2, head_cost=8.0) == [19, 11]
    assert partition_layers(30, 3, head_cost=8.0) == [13, 13, 4]
    assert partition_layers(32, 4, head_cost=2.4) == [9, 9, 8, 6]
    assert partition_layers(2, 2, head_cost=8.0) == [1, 1]  # every stage keeps a layer
    assert partition_layers(30, 2, (15, 15), head_cost=8.0) == [15, 15]  # asked: kept


def test_the_embedded_models_head_is_worth_eight_layers() -> None:
    from types import SimpleNamespace

    from kvflow.gpu_worker.models.llama import lm_head_cost

    smollm2 = SimpleNamespace(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    )
    assert lm_head_cost(smollm2) == pytest.approx(8.0, abs=0.05)


def test_layers_split_evenly_the_first_stages_take_the_remainder() -> None:
    assert partition_layers(3, 2) == [2, 1]
    assert partition_layers(10, 4) == [3, 3, 2, 2]
    assert partition_layers(3, 2, (1, 2)) == [1, 2]
    stages = [PPGroup(size=3, stage=s) for s in range(3)]
    assert [g.layer_range(7) for g in stages] == [(0, 3), (3, 5), (5, 7)]
    assert stages[0].is_first and not stages[0].is_last and stages[2].is_last


def test_ranks_are_stage_major_and_carry_the_pipeline_shape() -> None:
    config = EngineConfig.create(
        device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition="1,2"
    )
    inits = [a[4] for a in worker_rank_args(config, ServiceAddresses.ipc("/tmp/x"), Path("/m"))]
    assert [i.rank for i in inits] == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert all(i.world_size == 4 and i.tensor_parallel_size == 2 for i in inits)  # type: ignore[union-attr]
    assert all(i.layer_partition == (1, 2) for i in inits)  # type: ignore[union-attr]
    assert config.max_steps_in_flight == 2  # one micro-batch per stage
    assert EngineConfig.create(device="cpu", async_scheduling=True).max_steps_in_flight == 2
    assert EngineConfig.create(device="cpu").max_steps_in_flight == 1


def test_each_rank_gets_its_rank_and_the_group_address() -> None:
    config = EngineConfig.create(device="cpu", tensor_parallel_size=2)
    addresses = ServiceAddresses.ipc("/tmp/x")
    args = worker_rank_args(config, addresses, Path("/m"))
    assert [a[2] for a in args] == [0, 1]
    inits = [a[4] for a in args]
    assert all(isinstance(i, RankInit) for i in inits)
    assert inits[0].init_method == inits[1].init_method  # type: ignore[union-attr]
    single = worker_rank_args(EngineConfig.create(device="cpu"), addresses, Path("/m"))
    assert single == [(single[0][0], addresses, 0, Path("/m"), None)]


def test_a_rank_of_a_group_is_never_restarted_alone() -> None:
    policy = RestartPolicy(max_worker_restarts=3)
    assert restart_policy(EngineConfig.create(device="cpu"), policy) is policy
    tp = EngineConfig.create(device="cpu", tensor_parallel_size=2)
    assert restart_policy(tp, policy).max_worker_restarts == 0


def test_tensor_parallel_size_must_split_heads_and_mlp(tmp_path: Path) -> None:
    # The embedded SmolLM2-135M's shape: 9 heads, 3 KV heads, 1536 MLP columns.
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}'
    )
    check_tensor_split(ParallelConfig(tensor_parallel_size=3), tmp_path)
    with pytest.raises(ConfigError) as failed:
        check_model_split(ParallelConfig(tensor_parallel_size=2), tmp_path)
    assert str(failed.value) == (
        "tensor_parallel_size=2 must divide the model's 9 attention heads, its 1536 MLP "
        "columns and its 3 KV heads (or be a multiple of them); sizes that fit: 1, 3"
    )
    # Fewer KV heads than ranks: each KV head is shared by size/KV heads ranks.
    (tmp_path / "config.json").write_text(
        '{"text_config": {"num_attention_heads": 4, "num_key_value_heads": 1}}'
    )
    check_tensor_split(ParallelConfig(tensor_parallel_size=4), tmp_path)
    with pytest.raises(ConfigError, match=r"sizes that fit: 1, 2, 4$"):
        check_tensor_split(ParallelConfig(tensor_parallel_size=3), tmp_path)

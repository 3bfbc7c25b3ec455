"""The worker ranks' start-up arguments, thread split and failure policy (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.config import EngineConfig, ParallelConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.distributed import RankInit, rank_inits, threads_per_rank
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.children import RestartPolicy
from kvflow.services.worker_group import check_parallelism, restart_policy, worker_rank_args


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


def test_pipeline_parallelism_is_refused_tensor_parallelism_is_not() -> None:
    check_parallelism(ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        check_parallelism(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        check_parallelism(ParallelConfig(tensor_parallel_size=0))


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

"""A standalone `kvflow worker`'s place in its group (compose's `tp` profile, ranks on
several hosts): world size T x P from the engine flags, the rendezvous from
--distributed-init-method, and clear refusals for what cannot join (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.cli.serve import worker_rank_init
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.distributed import RankInit
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.launch.worker_group import worker_rank_args

RENDEZVOUS = "tcp://worker-tp0:29500"


def _config(tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig.create(device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_a_single_rank_joins_no_group() -> None:
    assert worker_rank_init(_config(), 0, None) is None
    assert worker_rank_init(_config(), 0, RENDEZVOUS) is None


def test_each_rank_of_a_group_meets_at_the_given_address() -> None:
    inits = [worker_rank_init(_config(tp=2), rank, RENDEZVOUS) for rank in (0, 1)]
    assert inits == [RankInit(RENDEZVOUS, 2, 0), RankInit(RENDEZVOUS, 2, 1)]


@pytest.mark.parametrize(
    ("rank", "init_method", "message"),
    [
        (2, RENDEZVOUS, "--rank 2 is outside the group of 2"),
        (-1, RENDEZVOUS, "--rank -1 is outside the group of 2"),
        (1, None, "needs --distributed-init-method"),
        (1, "worker-tp0:29500", "needs --distributed-init-method tcp://"),
    ],
)
def test_what_cannot_join_is_refused(rank: int, init_method: str | None, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        worker_rank_init(_config(tp=2), rank, init_method)


def test_a_rank_of_one_is_not_a_group_member() -> None:
    with pytest.raises(SystemExit, match="--rank 1 is outside the group of 1"):
        worker_rank_init(_config(), 1, None)


def test_the_world_is_tensor_times_pipeline_ranks() -> None:
    """Nothing here is TP-specific: T x P ranks meet at one address, standalone or
    launched, and each knows the stages."""
    config = _config(tp=2, pp=2)
    expected = RankInit(RENDEZVOUS, 4, 3, pipeline_parallel_size=2)
    assert worker_rank_init(config, 3, RENDEZVOUS) == expected
    with pytest.raises(SystemExit, match="outside the group of 4"):
        worker_rank_init(config, 4, RENDEZVOUS)
    args = worker_rank_args(config, ServiceAddresses.ipc("/tmp/x"), Path("/m"))
    inits = [a[4] for a in args]
    assert [a[2] for a in args] == [0, 1, 2, 3]
    assert all(isinstance(i, RankInit) and i.world_size == 4 for i in inits)
    assert len({i.init_method for i in inits if i is not None}) == 1


def test_a_pipeline_stage_joins_with_the_launchers_checks() -> None:
    """A stage is a member of the T x P group; what the launcher refuses (speculative
    decoding across stages) a standalone stage refuses the same way."""
    assert worker_rank_init(_config(pp=2), 1, RENDEZVOUS) == RankInit(
        RENDEZVOUS, 2, 1, pipeline_parallel_size=2
    )
    config = EngineConfig.create(
        device="cpu",
        pipeline_parallel_size=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(ConfigError, match="pipeline"):
        worker_rank_init(config, 1, RENDEZVOUS)

"""`--enable-expert-parallel` travels from the flags to every rank's tensor-parallel group,
served (worker_rank_args), standalone (`kvflow worker`) and in-process alike."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvflow.cli.args import add_engine_args, engine_options
from kvflow.cli.serve import worker_rank_init
from kvflow.config import EngineConfig
from kvflow.gpu_worker.distributed import RankInit
from kvflow.gpu_worker.parallel_state import get_tp_group, tensor_parallel
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.launch.worker_group import worker_rank_args


def _config(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return EngineConfig.create(**engine_options(parser.parse_args(["--device", "cpu", *flags])))


def test_the_flag_reaches_every_rank_init() -> None:
    config = _config("--tensor-parallel-size", "2", "--enable-expert-parallel")
    assert config.parallel.enable_expert_parallel
    args = worker_rank_args(config, ServiceAddresses.ipc("/tmp/x"), Path("/m"))
    inits = [a[4] for a in args]
    assert all(isinstance(i, RankInit) and i.expert_parallel for i in inits)
    standalone = worker_rank_init(config, 1, "tcp://rank0:29500")
    assert standalone is not None and standalone.expert_parallel


def test_off_by_default() -> None:
    config = _config("--tensor-parallel-size", "2")
    assert not config.parallel.enable_expert_parallel
    args = worker_rank_args(config, ServiceAddresses.ipc("/tmp/x"), Path("/m"))
    assert not any(a[4].expert_parallel for a in args)  # type: ignore[union-attr]


def test_the_group_carries_it_to_the_layers() -> None:
    assert not get_tp_group().expert_parallel
    with tensor_parallel(2, 1, expert_parallel=True):
        assert get_tp_group().expert_parallel and get_tp_group().rank == 1
    assert not get_tp_group().expert_parallel

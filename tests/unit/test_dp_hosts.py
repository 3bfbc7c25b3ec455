"""Engines on several hosts: which ranks run here, the join handshake's rules, the
resources a Ray engine holds, and loopback addresses binding loopback only."""

from __future__ import annotations

from dataclasses import asdict

import msgspec
import pytest

from kvflow.config import EngineConfig
from kvflow.errors import ConfigError
from kvflow.proto.addresses import ServiceAddresses, bind_address
from kvflow.proto.data_parallel import EngineJoin, EngineJoined
from kvflow.services.launch.dp_hosts import (
    DataParallelHosts,
    RemoteEngine,
    _accept,
    free_tcp_addresses,
    reachable_host,
)
from kvflow.services.launch.ray_executor import engine_bundle


def test_local_ranks() -> None:
    assert DataParallelHosts().local_ranks(3) == range(3)
    assert DataParallelHosts(rpc_port=1, size_local=1).local_ranks(3) == range(1)
    headless = DataParallelHosts(rpc_port=1, size_local=2, start_rank=1, headless=True)
    assert headless.local_ranks(3) == range(1, 3)


@pytest.mark.parametrize(
    "hosts, match",
    [
        (DataParallelHosts(size_local=1), "rpc-port"),  # others must be able to join
        (DataParallelHosts(rpc_port=1, size_local=2, start_rank=2, headless=True), "fit"),
        (DataParallelHosts(rpc_port=1, size_local=0), "fit"),
        (DataParallelHosts(rpc_port=1, start_rank=1), "rank 0"),  # the frontend's host
    ],
)
def test_local_ranks_refused(hosts: DataParallelHosts, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        hosts.local_ranks(3)


def _join(index: int, size: int = 3) -> bytes:
    addresses = free_tcp_addresses("127.0.0.1")
    return msgspec.msgpack.encode(EngineJoin(index, asdict(addresses), size))


def test_accept_each_expected_engine_once() -> None:
    decoder = msgspec.msgpack.Decoder(EngineJoin | EngineJoined)
    joined: dict[int, RemoteEngine] = {}
    expected = {1, 2}
    assert _accept(decoder, _join(1), expected, joined, 3) == EngineJoined(True)
    assert not _accept(decoder, _join(1), expected, joined, 3).accepted  # twice
    assert not _accept(decoder, _join(0), expected, joined, 3).accepted  # runs here
    assert "size 3" in _accept(decoder, _join(2, size=2), expected, joined, 3).reason
    assert not _accept(decoder, b"\x01garbage", expected, joined, 3).accepted
    assert list(joined) == [1] and joined[1].addresses.stats.startswith("tcp://127.0.0.1:")


def test_free_tcp_addresses_differ() -> None:
    addresses = free_tcp_addresses("127.0.0.1")
    ports = {getattr(addresses, c).rsplit(":", 1)[1] for c in ServiceAddresses.channels()}
    assert len(ports) == len(ServiceAddresses.channels())
    assert reachable_host("127.0.0.1") == "127.0.0.1"


def test_loopback_binds_loopback_only() -> None:
    assert bind_address("tcp://127.0.0.1:5550") == "tcp://127.0.0.1:5550"
    assert bind_address("tcp://scheduler:5550") == "tcp://*:5550"
    assert bind_address("ipc:///tmp/x/stats") == "ipc:///tmp/x/stats"


def test_engine_bundle_packs_an_engine_on_one_node() -> None:
    config = EngineConfig.create(model="m")
    assert engine_bundle(config, "cpu") == {"CPU": 2.0}  # scheduler+detokenizer, one rank
    assert engine_bundle(config, "cuda") == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize(("tp", "pp", "ranks"), [(2, 1, 2), (1, 2, 2), (2, 2, 4)])
def test_engine_bundle_holds_every_rank_of_a_tp_pp_group(tp: int, pp: int, ranks: int) -> None:
    """One bundle for all T x P ranks (STRICT_PACK: one node), so the group's
    collectives and its 127.0.0.1 rendezvous stay on that node."""
    config = EngineConfig.create(model="m", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert engine_bundle(config, "cpu") == {"CPU": 1.0 + ranks}
    assert engine_bundle(config, "cuda") == {"CPU": 1.0, "GPU": float(ranks)}


def test_ray_monitor_takes_a_lost_actor_out_for_good() -> None:
    from types import SimpleNamespace

    from kvflow.services.launch.ray_executor import RayEngine, _Monitor

    class Lost(Exception):
        pass

    answers: dict[str, object] = {"a": None, "b": "engine 1: scheduler exited with code 1"}

    def get(ref: object, timeout: float) -> object:
        if ref == "gone":
            raise Lost()
        if ref == "slow":
            raise TimeoutError()
        return answers[str(ref)]

    exceptions = SimpleNamespace(GetTimeoutError=TimeoutError, RayError=Lost)
    fake_ray = SimpleNamespace(get=get, exceptions=exceptions)

    def engine(index: int, ref: str) -> RayEngine:
        actor = SimpleNamespace(death=SimpleNamespace(remote=lambda: ref))
        return RayEngine(index, actor, None, free_tcp_addresses("127.0.0.1"))

    engines = [engine(0, "a"), engine(1, "b"), engine(2, "gone"), engine(3, "slow")]
    monitor = _Monitor(fake_ray, engines)
    for e in engines:
        monitor._poll(e)
    assert engines[0].death is None  # serving
    assert engines[1].death == answers["b"]  # down, its node restarts it
    assert engines[1].failure is None
    assert engines[2].failure is not None and "Ray actor is gone" in engines[2].failure
    assert engines[3].death is None  # a late answer is no death
    answers["b"] = None  # restarted on its node: back into routing
    monitor._poll(engines[1])
    assert engines[1].death is None

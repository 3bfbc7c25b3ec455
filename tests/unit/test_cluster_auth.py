"""The cluster's links: CURVE keys from one secret, a ZAP handler that refuses any other
key (counted), limits on every socket, and tcp:// refused without a secret.

Each channel gets a rogue peer without the key, both kinds: one that speaks no CURVE at
all, and one with CURVE keys of its own (it even knows the server's public key). The
channels run in process here; tests/integration/test_cluster_links.py probes the served
ones (headless engines, the P/D proxy's signed parameters)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvflow.cluster_secret import INSECURE_ENV, SECRET_FILE_ENV, ClusterSecret, ClusterSettings
from kvflow.errors import ConfigError
from kvflow.kv_transfer.worker.zmq_connector import ZmqWorker
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.data_parallel import EngineJoin
from kvflow.proto.engine import AbortRequests
from kvflow.proto.kv_transfer import KVPull
from kvflow.runtime.cluster_auth import (
    HWM,
    REFUSALS,
    cluster_settings,
    curve_keys,
    secure_socket,
)
from kvflow.runtime.lifecycle import StopFlag
from kvflow.runtime.sockets import TypedSocket
from kvflow.services.launch.dp_hosts import (
    DataParallelHosts,
    await_joins,
    free_tcp_addresses,
    join,
)
from kvflow.services.scheduler.main import _SchedulerSockets

WAIT_S = 1.0


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _address() -> str:
    return free_tcp_addresses("127.0.0.1").stats


def rogue(context: zmq.Context[Any], kind: int, address: str, with_curve: bool) -> zmq.Socket[Any]:
    """A peer without the cluster's key: plain, or CURVE with keys of its own."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if with_curve:
        public, secret = zmq.curve_keypair()
        socket.curve_serverkey = curve_keys(cluster_settings())[0]
        socket.curve_publickey = public
        socket.curve_secretkey = secret
    socket.connect(address)
    return socket


def test_keys_derive_from_the_secret_alone() -> None:
    one = ClusterSettings(ClusterSecret(b"a" * 32))
    assert curve_keys(one) == curve_keys(ClusterSettings(ClusterSecret(b"a" * 32)))
    other = curve_keys(ClusterSettings(ClusterSecret(b"b" * 32)))
    assert not set(curve_keys(one)) & set(other)
    server_public, server_secret, client_public, _ = curve_keys(one)
    assert zmq.curve_public(server_secret) == server_public != client_public
    with pytest.raises(ConfigError, match="at least"):
        ClusterSecret(b"short")


def test_tcp_without_a_secret_is_refused(
    context: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV)
    socket = context.socket(zmq.PULL)
    with pytest.raises(ConfigError, match="--cluster-secret-file"):
        secure_socket(socket, "tcp://127.0.0.1:5550", bind=True)
    assert secure_socket(socket, "ipc:///tmp/x", bind=True) == "ipc:///tmp/x"  # ipc: as is


def test_insecure_cluster_binds_loopback_and_warns(
    context: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV)
    monkeypatch.setenv(INSECURE_ENV, "1")
    socket = context.socket(zmq.PULL)
    with caplog.at_level(logging.WARNING):
        assert secure_socket(socket, "tcp://*:5551", bind=True) == "tcp://127.0.0.1:5551"
    assert "loopback only" in caplog.text
    assert secure_socket(socket, "tcp://10.1.2.3:5551", bind=True) == "tcp://127.0.0.1:5551"
    assert secure_socket(socket, "tcp://peer:5551", bind=False) == "tcp://peer:5551"
    assert socket.getsockopt(zmq.CURVE_SERVER) == 0  # no key to use


def test_limits_on_every_socket(context: zmq.Context[Any]) -> None:
    for address in ("ipc:///tmp/kvflow-limits", _address()):
        typed = TypedSocket.open(context, zmq.PUSH, address, bind=False)
        assert typed.socket.getsockopt(zmq.SNDHWM) == HWM
        assert typed.socket.getsockopt(zmq.RCVHWM) == HWM
        assert typed.socket.getsockopt(zmq.MAXMSGSIZE) > 0
        typed.close()


def test_an_oversize_message_is_dropped_not_buffered(context: zmq.Context[Any]) -> None:
    address = _address()
    pull = TypedSocket.open(
        context, zmq.PULL, address, bind=True, recv_type=AbortRequests, max_message_bytes=1000
    )
    push = TypedSocket.open(context, zmq.PUSH, address, bind=False)
    push.send(AbortRequests(["x" * 2000]))
    assert pull.recv(timeout_ms=500) is None  # its sender was cut off instead
    push.close()
    push = TypedSocket.open(context, zmq.PUSH, address, bind=False)
    push.send(AbortRequests(["fits"]))  # the socket still serves
    assert pull.recv(timeout_ms=5000) == AbortRequests(["fits"])
    push.close()
    pull.close()


@pytest.mark.parametrize("with_curve", [False, True], ids=["no-curve", "foreign-key"])
def test_role_sockets_refuse_a_rogue(context: zmq.Context[Any], with_curve: bool) -> None:
    """The scheduler's sockets on tcp (compose, headless): a rogue can neither inject a
    request, nor subscribe to the plans (every prompt's token ids), nor fake a result."""
    addresses = free_tcp_addresses("127.0.0.1")
    sockets = _SchedulerSockets(context, addresses)
    try:
        before = REFUSALS.count
        inject = rogue(context, zmq.PUSH, addresses.scheduler_input, with_curve)
        inject.send(msgspec.msgpack.encode(AbortRequests(["everything"])))
        spy = rogue(context, zmq.SUB, addresses.worker_plan, with_curve)
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        fake = rogue(context, zmq.PUSH, addresses.worker_result, with_curve)
        fake.send(b"\x00")
        assert wait_for(lambda: REFUSALS.count >= before + 3)
        time.sleep(0.2)
        assert sockets.inbox.empty()  # nothing in, not even a disconnect hint
        assert sockets.count_subscriptions() == 0
        member = TypedSocket.open(context, zmq.PUSH, addresses.scheduler_input, bind=False)
        member.send(AbortRequests(["mine"]))
        assert sockets.inbox.get(timeout=5.0) == AbortRequests(["mine"])
        for socket in (inject, spy, fake):
            socket.close()
        member.close()
    finally:
        sockets.close()


@pytest.mark.parametrize("with_curve", [False, True], ids=["no-curve", "foreign-key"])
def test_a_forged_engine_join_is_refused(context: zmq.Context[Any], with_curve: bool) -> None:
    """The DP join port: a forged EngineJoin (the attacker's addresses) gets no answer;
    the real engine's join is accepted."""
    port = int(_address().rsplit(":", 1)[1])
    hosts = DataParallelHosts(rpc_port=port, size_local=1)
    joined: list[Any] = []
    waiter = threading.Thread(
        target=lambda: joined.extend(await_joins(hosts, 2, context, 20.0, StopFlag()))
    )
    waiter.start()
    before = REFUSALS.count
    forger = rogue(context, zmq.DEALER, hosts.join_address, with_curve)
    evil = free_tcp_addresses("127.0.0.1")
    forger.send(msgspec.msgpack.encode(EngineJoin(1, asdict(evil), 2)))
    assert not forger.poll(int(WAIT_S * 1000))  # no EngineJoined, accepted or not
    assert REFUSALS.count > before
    forger.close()
    real = free_tcp_addresses("127.0.0.1")
    join(hosts, 1, real, 2, timeout_s=10.0)
    waiter.join(timeout=10.0)
    assert [engine.addresses for engine in joined] == [real]


@pytest.mark.parametrize("with_curve", [False, True], ids=["no-curve", "foreign-key"])
def test_kv_producer_serves_only_the_cluster(with_curve: bool) -> None:
    port = int(_address().rsplit(":", 1)[1])
    extra = {"kv_port": port}
    config = KVTransferConfig("kv_producer", "zmq", extra)
    caches = [torch.zeros(4, 2, 4, 2, 8)]  # [blocks, K/V, block_size, kv_heads, head_dim]
    producer = ZmqWorker(config, caches, load_timeout_s=2.0)
    context: zmq.Context[Any] = zmq.Context()
    try:
        producer._buffer.put("k0", caches[0][0].numpy().view("uint8"))
        before = REFUSALS.count
        thief = rogue(context, zmq.DEALER, f"tcp://127.0.0.1:{port}", with_curve)
        thief.send(msgspec.msgpack.encode(KVPull("r", ["k0"])))
        assert not thief.poll(int(WAIT_S * 1000))  # no blocks for it
        assert REFUSALS.count > before
        thief.close()
        member = context.socket(zmq.DEALER)
        member.connect(secure_socket(member, f"tcp://127.0.0.1:{port}", bind=False))
        member.send(msgspec.msgpack.encode(KVPull("r", ["k0"])))
        assert member.poll(5000)
        assert len(member.recv_multipart()) == 2  # the header and the one block
        member.close()
    finally:
        producer.close()
        context.destroy(linger=0)


def test_role_links_refused_at_start_without_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow.cli.main import main

    monkeypatch.delenv(SECRET_FILE_ENV)
    tcp = [
        f"--addr-{c.replace('_', '-')}=tcp://127.0.0.1:{5560 + i}"
        for i, c in enumerate(ServiceAddresses.channels())
    ]
    with pytest.raises(SystemExit, match="no cluster secret"):
        main(["detokenizer", *tcp])
    with pytest.raises(SystemExit, match="data-parallel-rpc-port"):
        main(
            [
                "serve",
                "--data-parallel-size",
                "2",
                "--data-parallel-size-local",
                "1",
                "--data-parallel-rpc-port",
                "5570",
            ]
        )
    proxy = ["proxy", "--prefill", "http://p:8000", "--decode", "http://d:8000"]
    with pytest.raises(SystemExit, match="needs the cluster secret"):  # it could not sign
        main([*proxy, "--prefill-kv-address", "tcp://p:8200"])
    with pytest.raises(SystemExit, match="cannot read"):
        main(["serve", "--cluster-secret-file", "/nonexistent/secret"])


def test_refusals_reach_the_frontends_metrics() -> None:
    """This process's own (the data-parallel join runs in the frontend's process) and
    each engine's, by the role that refused the peer, as counters that never go back."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvflow.proto.stats import SchedulerStats
    from kvflow.services.frontend.metrics import FrontendMetrics

    metrics = FrontendMetrics("m", 64)
    stats = SchedulerStats(0.0, "1", 0, 0, 0.0, cluster_auth_failures={"scheduler": 3})
    metrics.observe_scheduler_stats(stats)
    stats.cluster_auth_failures = {"scheduler": 5, "detokenizer": 1}
    metrics.observe_scheduler_stats(stats)
    REFUSALS.add("a test's refusal")

    def values() -> dict[tuple[str, str], float]:
        text = metrics.render().decode()
        return {
            (s.labels["engine"], s.labels["role"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "kvflow:cluster_auth_failures_total"
        }

    assert values() == {
        ("", "frontend"): REFUSALS.count,
        ("1", "scheduler"): 5,
        ("1", "detokenizer"): 1,
    }
    REFUSALS.add("another")
    assert values()[("", "frontend")] == REFUSALS.count

"""Data-parallel engines on several hosts without Ray: the frontend's host runs engines
`0..local-1` and waits for the others to join; `kvflow serve --headless` runs engines
on another host and joins them (vLLM's headless mode).

    host A: kvflow serve --data-parallel-size 2 --data-parallel-size-local 1 \\
                --data-parallel-address A --data-parallel-rpc-port 13345
    host B: kvflow serve --headless --data-parallel-size 2 --data-parallel-size-local 1 \\
                --data-parallel-start-rank 1 --data-parallel-address A --data-parallel-rpc-port 13345

A headless engine binds its channels on tcp (the address that reaches host A), starts,
then sends `EngineJoin` (proto/data_parallel.py) to A's rpc port; A accepts the ranks it
does not run itself, once each. Host A's frontend then connects to B's sockets. A joined
engine that dies is restarted on its own host (same ports); meanwhile its silence
(no stats for the frontend's `stats_timeout_s`) keeps it out of routing.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass

import msgspec
import zmq

from kvflow.errors import ConfigError, KvflowError
from kvflow.proto.addresses import ServiceAddresses, bind_address
from kvflow.proto.data_parallel import DataParallelMessage, EngineJoin, EngineJoined
from kvflow.runtime.cluster_auth import secure_socket
from kvflow.runtime.lifecycle import StopFlag

_POLL_MS = 200


@dataclass(frozen=True)
class DataParallelHosts:
    """Where this host's engines sit among `data_parallel_size` (all flags optional
    until an engine runs elsewhere)."""

    address: str = "127.0.0.1"  # the frontend host's, where headless engines join
    rpc_port: int | None = None  # the join port on `address`
    size_local: int | None = None  # engines on this host (default: all of them)
    start_rank: int = 0  # the first engine index on this host
    headless: bool = False  # run engines only; the frontend is on `address`

    def local_ranks(self, size: int) -> range:
        """Indices of the engines that run on this host (checked against `size`)."""
        local = size - self.start_rank if self.size_local is None else self.size_local
        if self.start_rank < 0 or local < 1 or self.start_rank + local > size:
            raise ConfigError(
                f"engines {self.start_rank}..{self.start_rank + local - 1} on this host do "
                f"not fit --data-parallel-size {size}"
            )
        if not self.headless and self.start_rank != 0:
            raise ConfigError("the frontend's host runs engines from rank 0 (start rank 0)")
        if (self.headless or local < size) and self.rpc_port is None:
            raise ConfigError("engines on several hosts need --data-parallel-rpc-port")
        return range(self.start_rank, self.start_rank + local)

    @property
    def join_address(self) -> str:
        return f"tcp://{self.address}:{self.rpc_port}"


def reachable_host(peer: str) -> str:
    """This host's address on the route to `peer` (no packet is sent: UDP connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return str(probe.getsockname()[0])


def free_tcp_addresses(host: str) -> ServiceAddresses:
    """One free port on `host` per channel (held open together, so they differ)."""
    sockets = [socket.socket() for _ in ServiceAddresses.channels()]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        ports = [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    channels = ServiceAddresses.channels()
    return ServiceAddresses(**{c: f"tcp://{host}:{p}" for c, p in zip(channels, ports)})


@dataclass(frozen=True)
class RemoteEngine:
    """An engine that joined from another host, as the frontend routes to it."""

    index: int
    addresses: ServiceAddresses
    death: str | None = None  # its host restarts it; silence takes it out of routing


def await_joins(
    hosts: DataParallelHosts, size: int, context: zmq.Context, timeout_s: float, stop: StopFlag
) -> list[RemoteEngine]:
    """On the frontend's host: until every engine not run here has joined."""
    expected = set(range(size)) - set(hosts.local_ranks(size))
    joined: dict[int, RemoteEngine] = {}
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 1000)  # the last answer still leaves
    # CURVE: only a holder of the cluster secret gets to send an EngineJoin at all.
    router.bind(secure_socket(router, bind_address(hosts.join_address), bind=True))
    decoder = msgspec.msgpack.Decoder(DataParallelMessage)
    deadline = time.monotonic() + timeout_s
    try:
        while expected - joined.keys():
            if stop.is_set():
                raise KvflowError("interrupted while waiting for engines to join")
            if time.monotonic() > deadline:
                missing = sorted(expected - joined.keys())
                raise KvflowError(f"engines {missing} did not join within {timeout_s:g} s")
            if router.poll(_POLL_MS, zmq.POLLIN):
                peer, payload = router.recv_multipart()
                answer = _accept(decoder, payload, expected, joined, size)
                router.send_multipart([peer, msgspec.msgpack.encode(answer)])
    finally:
        router.close()
    return [joined[i] for i in sorted(joined)]


def _accept(
    decoder: msgspec.msgpack.Decoder[DataParallelMessage],
    payload: bytes,
    expected: set[int],
    joined: dict[int, RemoteEngine],
    size: int,
) -> EngineJoined:
    try:
        message = decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return EngineJoined(False, f"malformed join: {exc}")
    if not isinstance(message, EngineJoin):
        return EngineJoined(False, "expected EngineJoin")
    if message.data_parallel_size != size:
        return EngineJoined(False, f"this frontend serves --data-parallel-size {size}")
    if message.index not in expected or message.index in joined:
        return EngineJoined(False, f"engine {message.index} is not expected or already joined")
    try:
        addresses = ServiceAddresses(**message.addresses)
    except TypeError as exc:
        return EngineJoined(False, f"bad addresses: {exc}")
    joined[message.index] = RemoteEngine(message.index, addresses)
    return EngineJoined(True)


def join(
    hosts: DataParallelHosts, index: int, addresses: ServiceAddresses, size: int, timeout_s: float
) -> None:
    """On a headless host: announce one ready engine to the frontend's host."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(secure_socket(dealer, hosts.join_address, bind=False))
    try:
        dealer.send(msgspec.msgpack.encode(EngineJoin(index, asdict(addresses), size)))
        if not dealer.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise KvflowError(f"no frontend answered at {hosts.join_address} in {timeout_s:g} s")
        answer = msgspec.msgpack.decode(dealer.recv(), type=DataParallelMessage)
    finally:
        dealer.close()
    if not isinstance(answer, EngineJoined) or not answer.accepted:
        reason = answer.reason if isinstance(answer, EngineJoined) else "unexpected answer"
        raise KvflowError(f"engine {index} was refused by {hosts.join_address}: {reason}")

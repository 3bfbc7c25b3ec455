"""CURVE on every tcp:// ZeroMQ socket, a ZAP handler that admits only the cluster's
client key, and the limits every socket gets (high-water marks, largest message).

    binder (server)                                      connector (client)
    CURVE_SERVER, server secret key  ◀── handshake ───  CURVE_SERVERKEY, client key pair
         │ ZAP request (inproc://zeromq.zap.01, per context)
         ▼
    ClusterGuard thread: 200 if the client key is the cluster's, else 400 (counted);
    handshakes that fail before ZAP (no CURVE at all, garbage) are counted from the
    monitor of each bound socket.

Both key pairs derive from the cluster secret (kvflow/cluster_secret.py), so every role
holds both: whichever side binds is the server. ipc:// sockets (a 0700 directory of one
host) stay plain. A tcp:// socket without a secret is refused (ConfigError) unless the
cluster is explicitly insecure; then it binds loopback only, with a warning.

The guards are per ZeroMQ context (ZAP is a context's inproc endpoint), kept in a
registry keyed by the context; the refusal count is one per process, read by whatever
exports this process's metrics.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvflow.cluster_secret import INSECURE_ENV, SECRET_FILE_ENV, ClusterSettings
from kvflow.errors import ConfigError

logger = logging.getLogger(__name__)

# Queued messages per socket and direction. Bounded, so a stuck peer costs at most this
# much memory; far above what a healthy pipeline holds (a few steps in flight).
HWM = 10_000
# The largest frame a role socket takes. A StepPlan carries whole prompts of new requests
# (max_num_seqs x max_model_len token ids, ~5 bytes each in MessagePack) and a StepResult
# a prompt's logprobs: 256 MiB covers 256 requests of 128k tokens with room to spare.
# A larger frame disconnects its sender; it is never buffered.
MAX_MESSAGE_BYTES = 256 << 20
ZAP_DOMAIN = b"kvflow"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_FAILED_HANDSHAKE = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# Every failed handshake, ZAP's refusals (counted by the guard itself) included.
REFUSAL_EVENTS = _FAILED_HANDSHAKE | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_POLL_MS = 100


@functools.lru_cache(maxsize=4)
def _settings_for(secret_file: str, insecure: str) -> ClusterSettings:
    return ClusterSettings.from_env({SECRET_FILE_ENV: secret_file, INSECURE_ENV: insecure})


def cluster_settings() -> ClusterSettings:
    """This process's settings, from the environment the CLI set (children inherit it)."""
    return _settings_for(os.environ.get(SECRET_FILE_ENV, ""), os.environ.get(INSECURE_ENV, ""))


class _Refusals:
    """Refused peers of this process, cumulative (a Prometheus counter's source). A
    refused peer retries (ZeroMQ reconnects), so the log says it once per interval."""

    LOG_EVERY_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._logged_at = -self.LOG_EVERY_S

    def add(self, why: str) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._logged_at < self.LOG_EVERY_S:
                return
            self._logged_at = now
        logger.warning("refused a cluster peer (%d so far): %s", self._count, why)

    @property
    def count(self) -> int:
        with self._lock:
            return self._count


REFUSALS = _Refusals()


def curve_keys(settings: ClusterSettings) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret), Z85-encoded."""
    assert settings.secret is not None
    server_secret = z85.encode(settings.secret.derive("curve-server"))
    client_secret = z85.encode(settings.secret.derive("curve-client"))
    return (
        zmq.curve_public(server_secret),
        server_secret,
        zmq.curve_public(client_secret),
        client_secret,
    )


def secure_socket(
    socket: zmq.Socket[Any],
    address: str,
    *,
    bind: bool,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    settings: ClusterSettings | None = None,
) -> str:
    """Apply the limits, and CURVE on tcp://; returns the address to bind or connect.
    Call before bind/connect (the options apply to connections made afterwards)."""
    socket.setsockopt(zmq.SNDHWM, HWM)
    socket.setsockopt(zmq.RCVHWM, HWM)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if not address.startswith("tcp://"):
        return address
    settings = settings or cluster_settings()
    reason = settings.tcp_refusal(address)
    if reason is not None:
        raise ConfigError(reason)
    if settings.secret is None:
        return _loopback_only(address) if bind else address
    server_public, server_secret, client_public, client_secret = curve_keys(settings)
    if bind:
        guard = guard_for(socket.context, client_public)
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler, no entry
        guard.watch(socket)
    else:
        socket.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, client_secret)
    return address


def _loopback_only(address: str) -> str:
    host, port = address[len("tcp://") :].rsplit(":", 1)
    if host in ("127.0.0.1", "localhost", "[::1]"):
        return address
    logger.warning(
        "--insecure-cluster: binding %s on loopback only (127.0.0.1:%s): tcp links are "
        "unauthenticated and unencrypted; give every process --cluster-secret-file instead",
        address,
        port,
    )
    return f"tcp://127.0.0.1:{port}"


_guards: dict[int, ClusterGuard] = {}
_guards_lock = threading.Lock()


def guard_for(context: zmq.Context[Any], client_public: bytes) -> ClusterGuard:
    """The ZAP handler of `context`, started on first use."""
    with _guards_lock:
        guard = _guards.get(context.underlying)
        if guard is None or not guard.alive:
            guard = _guards[context.underlying] = ClusterGuard(context, client_public)
        return guard


class ClusterGuard:
    """One thread per context: answers ZAP requests and reads the monitors of the bound
    sockets, counting every refused peer in REFUSALS."""

    def __init__(self, context: zmq.Context[Any], client_public: bytes) -> None:
        # A plain (not asyncio) handle of the same context: the thread blocks in poll.
        self._context: zmq.Context[Any] = zmq.Context.shadow(context.underlying)
        self._client_public = z85.decode(client_public)
        self._zap = self._context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        self._new_monitors: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvflow-zap", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def watch(self, socket: zmq.Socket[Any]) -> None:
        """Count `socket`'s failed handshakes (peers without CURVE, or not ZeroMQ)."""
        endpoint = f"inproc://kvflow-guard-{id(socket):x}-{id(self):x}"
        socket.monitor(endpoint, _FAILED_HANDSHAKE)
        self._new_monitors.put(endpoint)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: list[zmq.Socket[Any]] = []
        try:
            while True:
                self._connect_monitors(poller, monitors)
                for socket, _ in poller.poll(_POLL_MS):
                    if socket is self._zap:
                        self._answer(socket.recv_multipart())
                    else:
                        self._count_failure(socket)
        except zmq.ZMQError:  # the context was terminated: the process is ending
            pass
        finally:
            for socket in [self._zap, *monitors]:
                socket.close(linger=0)

    def _connect_monitors(self, poller: zmq.Poller, monitors: list[zmq.Socket[Any]]) -> None:
        while not self._new_monitors.empty():
            monitor = self._context.socket(zmq.PAIR)
            monitor.connect(self._new_monitors.get())
            poller.register(monitor, zmq.POLLIN)
            monitors.append(monitor)

    def _answer(self, frames: list[bytes]) -> None:
        # ZAP 1.0: version, request id, domain, address, identity, mechanism, credentials.
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        accepted = mechanism == b"CURVE" and credentials == [self._client_public]
        if not accepted:
            REFUSALS.add(
                f"{mechanism.decode(errors='replace')} from {address!r}: not the cluster's key"
            )
        status = (b"200", b"OK") if accepted else (b"400", b"not the cluster's key")
        self._zap.send_multipart(
            [version, request_id, *status, b"cluster" if accepted else b"", b""]
        )

    def _count_failure(self, monitor: zmq.Socket[Any]) -> None:
        event = recv_monitor_message(monitor)
        count_refused_handshake(event["event"], repr(event["endpoint"]))


def count_refused_handshake(event: int, endpoint: str) -> None:
    """Count a failed handshake seen by a socket's monitor (one the guard does not read:
    a socket has one monitor). ZAP's refusals (HANDSHAKE_FAILED_AUTH) are counted by the
    guard that refused them."""
    if event & _FAILED_HANDSHAKE:
        REFUSALS.add(f"handshake failed at {endpoint} (no CURVE, or not ZeroMQ)")

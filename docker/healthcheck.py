#!/usr/bin/env python3
"""Container health checks of the kvflow roles (installed as `kvflow-healthcheck`).

    kvflow-healthcheck http URL              GET URL answers 200 (frontend /health,
                                             Prometheus /-/ready); an https URL is
                                             checked against --ssl-ca-certs (else the
                                             system's CAs), with --ssl-certfile and
                                             --ssl-keyfile as the client certificate
                                             where the server asks for one
    kvflow-healthcheck stats tcp://H:P       a SchedulerStats arrives on the scheduler's
                                             stats PUB within --timeout (not EngineDead)
    kvflow-healthcheck listening PORT...     this container listens on every PORT
    kvflow-healthcheck connected PORT...     this container has an established TCP
                                             connection to every remote PORT

Exit status 0 = healthy, 1 = not (with the reason on stdout, which `docker inspect`
shows). Only `stats` needs kvflow's environment (pyzmq, msgspec, and the cluster secret
the container's KVFLOW_CLUSTER_SECRET_FILE names); the other checks use
the standard library, so the Prometheus image runs this file with Debian's python3.

Why these checks: the scheduler publishes stats only once its workers have loaded the
model and sent WorkerInfo, so a stats message means "the engine serves". The worker and
the detokenizer expose nothing to probe over the wire without side effects (a raw TCP
probe of a ZeroMQ port is a peer that connects and drops, which the scheduler reads as a
worker disconnect), so their checks read the kernel's socket table instead.
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.request
from pathlib import Path

_LISTEN = "0A"  # TCP state codes of /proc/net/tcp
_ESTABLISHED = "01"


def check_http(url: str, timeout_s: float, tls: ssl.SSLContext | None = None) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=tls) as response:
            status = int(response.status)
    except OSError as exc:  # URLError, HTTPError (non-2xx) and SSLError are OSErrors
        return f"GET {url}: {exc}"
    return None if status == 200 else f"GET {url}: HTTP {status}"


def client_tls(
    ca_certs: str | None, certfile: str | None, keyfile: str | None
) -> ssl.SSLContext | None:
    """The context an https check uses (None: the default one, the system's CAs)."""
    if ca_certs is None and certfile is None:
        return None
    context = ssl.create_default_context(cafile=ca_certs)
    if certfile is not None:
        context.load_cert_chain(certfile, keyfile)
    return context


def check_stats(address: str, timeout_s: float) -> str | None:
    import msgspec
    import zmq

    from kvflow.proto.frontend import EngineDead
    from kvflow.proto.stats import SchedulerStats
    from kvflow.runtime.cluster_auth import secure_socket

    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    # A member of the cluster: CURVE with the secret of KVFLOW_CLUSTER_SECRET_FILE.
    socket.connect(secure_socket(socket, address, bind=False))
    try:
        if not socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            return f"no scheduler stats on {address} within {timeout_s:g} s"
        frame = socket.recv_multipart()[-1]
    finally:
        context.destroy(linger=0)
    message = msgspec.msgpack.decode(frame, type=SchedulerStats | EngineDead)
    if isinstance(message, EngineDead):
        return f"engine dead: {message.reason}"
    return None


def socket_table() -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of every TCP socket in this network namespace."""
    rows: list[tuple[int, int, str]] = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(name)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            rows.append((_port(local), _port(remote), state))
    return rows


def _port(address: str) -> int:
    """The port of a /proc/net/tcp address (`0100007F:15B3`: hex ip, hex port)."""
    return int(address.rsplit(":", 1)[1], 16)


def check_ports(ports: list[int], *, listening: bool) -> str | None:
    table = socket_table()
    if listening:
        found = {local for local, _, state in table if state == _LISTEN}
        what = "listening on"
    else:
        found = {remote for _, remote, state in table if state == _ESTABLISHED}
        what = "connected to"
    missing = [port for port in ports if port not in found]
    return f"not {what} port(s) {missing}" if missing else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow-healthcheck", description=__doc__)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (http, stats)")
    sub = parser.add_subparsers(dest="check", required=True)
    http = sub.add_parser("http")
    http.add_argument("url")
    http.add_argument("--ssl-ca-certs", help="CA certificates (PEM) the server's must chain to")
    http.add_argument("--ssl-certfile", help="client certificate (PEM), for mutual TLS")
    http.add_argument("--ssl-keyfile", help="its private key (PEM)")
    sub.add_parser("stats").add_argument("address")
    for name in ("listening", "connected"):
        sub.add_parser(name).add_argument("ports", type=int, nargs="+")
    args = parser.parse_args(argv)
    if args.check == "http":
        try:
            tls = client_tls(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            print(f"TLS files do not load: {exc}")
            return 1
        problem = check_http(args.url, args.timeout, tls)
    elif args.check == "stats":
        problem = check_stats(args.address, args.timeout)
    else:
        problem = check_ports(args.ports, listening=args.check == "listening")
    print(problem or "ok")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())

"""The --ssl-* flags of `kvflow serve` and `kvflow frontend` (vLLM's names, uvicorn's
meaning): HTTPS for the API, and optionally client certificates (mutual TLS)."""

from __future__ import annotations

import argparse
import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.services.frontend.config import TlsConfig


def add_tls_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)"
    )
    group.add_argument(
        "--ssl-keyfile",
        default=None,
        help="the certificate's private key (PEM; omit if --ssl-certfile holds it)",
    )
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates (PEM) that client certificates must chain to",
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=ssl.CERT_NONE,
        choices=[ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED],
        help="client certificates: 0 not asked, 1 checked if sent, 2 required (mutual TLS)",
    )


def resolve_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The --ssl-* flags checked and their files loaded once, so a bad one is a start-up
    error and not one after the engine loaded; None: plain HTTP."""
    from kvflow.errors import ConfigError
    from kvflow.services.frontend.config import TlsConfig

    if args.ssl_certfile is None:
        given = [
            flag
            for flag, value in (
                ("--ssl-keyfile", args.ssl_keyfile),
                ("--ssl-ca-certs", args.ssl_ca_certs),
                ("--ssl-cert-reqs", args.ssl_cert_reqs or None),
            )
            if value is not None
        ]
        if given:
            raise SystemExit(f"kvflow: {', '.join(given)} without --ssl-certfile (HTTPS needs it)")
        return None
    try:
        tls = TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        tls.check_files()
    except ConfigError as exc:
        raise SystemExit(f"kvflow: {exc}") from None
    return tls

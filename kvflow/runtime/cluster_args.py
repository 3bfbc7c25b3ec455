"""`--cluster-secret-file` and `--insecure-cluster`: the flags of every command that opens
cluster links (serve, each role, proxy). They go into the environment, which the
processes this one starts inherit (kvflow/runtime/cluster_auth.py reads it)."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import tempfile

from kvflow.cluster_secret import INSECURE_ENV, SECRET_FILE_ENV, ClusterSettings
from kvflow.errors import ConfigError
from kvflow.runtime.cluster_auth import cluster_settings

logger = logging.getLogger(__name__)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster security (tcp:// links between processes)")
    group.add_argument(
        "--cluster-secret-file",
        default=None,
        help="the cluster secret (the same file for every process of the cluster): CURVE "
        "on every tcp:// ZeroMQ link, salted KV keys, signed kv_transfer_params "
        f"(env {SECRET_FILE_ENV}; make one with `openssl rand -hex 32 > FILE`)",
    )
    group.add_argument(
        "--insecure-cluster",
        action="store_true",
        help="allow tcp:// links without a secret: unauthenticated and unencrypted, bound "
        f"on loopback only (env {INSECURE_ENV}=1)",
    )


def apply_cluster_args(args: argparse.Namespace) -> ClusterSettings:
    """Export the flags to the environment and check the secret file now (exit 2 with
    the reason if it cannot be read)."""
    if args.cluster_secret_file:
        os.environ[SECRET_FILE_ENV] = os.path.abspath(args.cluster_secret_file)
    if args.insecure_cluster:
        os.environ[INSECURE_ENV] = "1"
    try:
        settings = cluster_settings()
    except ConfigError as exc:
        raise SystemExit(f"kvflow: {exc}") from None
    if settings.insecure and settings.secret is None:
        logger.warning(
            "--insecure-cluster: tcp:// links run without authentication or encryption "
            "and bind loopback only"
        )
    return settings


def exit_unless_tcp_allowed(links: dict[str, bool]) -> None:
    """Exit with the reason when a link that uses tcp:// (value True) may not: no secret
    and no --insecure-cluster. The sockets refuse too, but only once a process is up."""
    settings = cluster_settings()
    for what, uses_tcp in links.items():
        reason = settings.tcp_refusal(what) if uses_tcp else None
        if reason is not None:
            raise SystemExit(f"kvflow: {reason}")


def ensure_local_secret() -> None:
    """For a command that runs a whole cluster on this host by itself (the benchmarks):
    a fresh secret in a private temporary directory unless one is set already. Its
    processes inherit it through the environment; nothing outside them knows it."""
    if os.environ.get(SECRET_FILE_ENV):
        return
    directory = tempfile.mkdtemp(prefix="kvflow-secret-")  # 0700
    path = os.path.join(directory, "cluster_secret")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(secrets.token_hex(32))
    os.environ[SECRET_FILE_ENV] = path

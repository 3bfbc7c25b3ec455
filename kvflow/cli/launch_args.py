"""`kvflow serve`'s launch options: worker supervision, where the engines run (Ray or
this host), and engines on several hosts without Ray."""

from __future__ import annotations

import argparse

from kvflow.services.launch.children import RestartPolicy
from kvflow.services.launch.dp_hosts import DataParallelHosts


def add_restart_args(parser: argparse.ArgumentParser) -> None:
    defaults = RestartPolicy()
    group = parser.add_argument_group("supervision")
    group.add_argument(
        "--max-worker-restarts",
        type=int,
        default=defaults.max_worker_restarts,
        help="restarts of a dead worker (its requests resume) before the server exits 1",
    )
    group.add_argument(
        "--worker-restart-backoff",
        type=float,
        default=defaults.backoff_s,
        help="seconds before the first worker restart, doubled for each further one",
    )


def add_executor_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("placement")
    group.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default="mp",
        help="mp: every process on this host; ray: data-parallel engines on the nodes of a "
        "running Ray cluster (pip install 'kvflow[ray]')",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster's GCS address HOST:PORT (default: the one `ray start` "
        "recorded on this host)",
    )


def add_hosts_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engines on several hosts (without Ray)")
    group.add_argument(
        "--headless",
        action="store_true",
        help="run engines only, joined to the frontend at --data-parallel-address",
    )
    group.add_argument(
        "--data-parallel-address",
        default="127.0.0.1",
        help="the frontend's host, where engines on other hosts join",
    )
    group.add_argument(
        "--data-parallel-rpc-port", type=int, default=None, help="the join port on that host"
    )
    group.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="engines on this host (default: all of --data-parallel-size)",
    )
    group.add_argument(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        help="the first engine index on this host (headless hosts)",
    )


def dp_hosts(args: argparse.Namespace) -> DataParallelHosts:
    return DataParallelHosts(
        address=args.data_parallel_address,
        rpc_port=args.data_parallel_rpc_port,
        size_local=args.data_parallel_size_local,
        start_rank=args.data_parallel_start_rank,
        headless=args.headless,
    )

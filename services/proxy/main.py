"""`kvflow proxy --prefill URL --decode URL`: run the P/D proxy (uvicorn on uvloop)."""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from kvflow.errors import ConfigError
from kvflow.runtime.cluster_args import add_cluster_args
from kvflow.runtime.cluster_auth import cluster_settings
from kvflow.services.proxy.app import build_app
from kvflow.services.proxy.pairing import InstancePools
from kvflow.services.proxy.resend import ResendPolicy


def add_proxy_parser(subparsers: Any) -> None:
    proxy = subparsers.add_parser(
        "proxy", help="OpenAI-compatible front pairing prefill and decode instances"
    )
    proxy.add_argument(
        "--prefill", action="append", required=True, help="a prefill instance's base URL (repeat)"
    )
    proxy.add_argument(
        "--decode", action="append", required=True, help="a decode instance's base URL (repeat)"
    )
    proxy.add_argument(
        "--prefill-kv-address",
        action="append",
        default=[],
        help="zmq connector: each prefill instance's KV address tcp://host:port (same order)",
    )
    proxy.add_argument("--host", default="127.0.0.1", help="address to bind")
    proxy.add_argument("--port", type=int, default=8000, help="port to bind")
    proxy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds an instance may take to answer"
    )
    proxy.add_argument(
        "--resend-max",
        type=int,
        default=3,
        help="times a request is resent (or its stream resumed) after a decode instance "
        "dropped it or answered a 5xx",
    )
    proxy.add_argument(
        "--resend-wait",
        type=float,
        default=60.0,
        help="seconds a failed request may wait for a decode instance to take it again",
    )
    proxy.add_argument(
        "--no-prefill-fallback",
        action="store_true",
        help="never send a request whole to a prefill instance when no decode instance answers",
    )
    add_cluster_args(proxy)
    proxy.set_defaults(handler=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    pools = InstancePools(
        [u.rstrip("/") for u in args.prefill],
        [u.rstrip("/") for u in args.decode],
        args.prefill_kv_address,
    )
    try:
        policy = ResendPolicy(
            max_resends=args.resend_max,
            wait_s=args.resend_wait,
            prefill_fallback=not args.no_prefill_fallback,
        )
        app = build_app(pools, args.timeout, cluster_settings().secret, policy)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"kvflow proxy: {exc}") from None
    print(f"kvflow proxy: http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", log_level="warning")
    return 0

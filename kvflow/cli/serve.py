"""`kvflow serve` and the single-role commands (`kvflow scheduler|worker|detokenizer|
frontend`), which is how compose runs one role per container.

A role's channel addresses come, per channel, from `--addr-<channel>` (e.g.
`--addr-scheduler-input tcp://scheduler:5550`), else `--ipc-dir DIR` (every channel an
ipc socket in DIR, for several roles on one host), else `KVFLOW_ADDR_<CHANNEL>`.
A role binds the channels it owns (`tcp://host:port` binds `tcp://*:port`) and connects
to the others, so roles may start in any order.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.cli.args import add_engine_args, engine_options
from kvflow.cli.launch_args import add_executor_args, add_hosts_args, add_restart_args, dp_hosts
from kvflow.cli.media_args import add_media_args, resolve_media
from kvflow.cli.tls_args import add_tls_args, resolve_tls
from kvflow.config import EngineConfig
from kvflow.proto.addresses import ServiceAddresses
from kvflow.runtime.cluster_args import add_cluster_args, exit_unless_tcp_allowed
from kvflow.services.launch.children import RestartPolicy
from kvflow.services.scheduler.recovery import WORKER_RECOVERY_TIMEOUT_S

if TYPE_CHECKING:
    from kvflow.gpu_worker.distributed import RankInit


def add_serve_parsers(subparsers: Any) -> None:
    """Add `serve` and the four role commands to the `kvflow` sub-command parser."""
    serve = subparsers.add_parser("serve", help="serve the OpenAI-compatible API (all roles)")
    _add_server_args(serve)
    serve.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for every role to start"
    )
    add_restart_args(serve)
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP frontend processes sharing the port (SO_REUSEPORT)",
    )
    _add_trace_arg(serve)
    add_executor_args(serve)
    add_hosts_args(serve)
    add_cluster_args(serve)
    add_engine_args(serve)
    serve.set_defaults(handler=_run_serve)

    roles = {
        "scheduler": ("the engine core: batching, KV blocks", _run_scheduler),
        "worker": ("one model rank: weights, KV cache, sampling", _run_worker),
        "detokenizer": ("token ids to text, stop strings, routing", _run_detokenizer),
        "frontend": ("the HTTP API of a separately started engine", _run_frontend),
    }
    for role, (help_text, handler) in roles.items():
        parser = subparsers.add_parser(role, help=f"run one role: {help_text}")
        _add_address_args(parser)
        if role == "frontend":
            _add_server_args(parser)
        else:
            parser.add_argument("--launcher-address", help="where to ack ProcessReady")
        if role == "worker":
            parser.add_argument("--rank", type=int, default=0, help="this worker's rank")
            parser.add_argument(
                "--distributed-init-method",
                default=os.environ.get("KVFLOW_DIST_INIT_METHOD"),
                help="tcp://host:port of rank 0's rendezvous, shared by the engine's "
                "tensor x pipeline parallel ranks; rank 0 listens on host's interface only "
                "(torch's store has no authentication: keep it on a private network; env "
                "KVFLOW_DIST_INIT_METHOD)",
            )
        if role == "scheduler":
            _add_trace_arg(parser)
            parser.add_argument(
                "--worker-recovery-timeout",
                type=float,
                default=WORKER_RECOVERY_TIMEOUT_S,
                help="seconds a lost worker may take to come back before the scheduler exits 1",
            )
            parser.add_argument(
                "--engine-id", default="0", help="this engine's data-parallel rank (metric label)"
            )
        add_cluster_args(parser)
        add_engine_args(parser)
        parser.set_defaults(handler=handler)


def _add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace-file",
        default=None,
        help="write a Chrome/Perfetto trace (JSON) of the scheduler's steps to this path",
    )


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' (visible in ps: prefer "
        "--api-key-file or KVFLOW_API_KEY)",
    )
    group.add_argument("--api-key-file", default=None, help="read the API key from this file")
    group.add_argument(
        "--resend-wait",
        type=float,
        default=60.0,
        help="seconds a request whose engine failed, with no other engine to take it, "
        "waits for one to serve again (then it is resent and goes on); 0: it ends with "
        "an error at once",
    )
    add_tls_args(group)
    add_media_args(group)
    group.add_argument(
        "--reasoning-parser",
        default=None,
        help="split chat output at its think tags into reasoning_content and content: "
        "qwen3, deepseek_r1, or auto (chosen from the chat template)",
    )


def _add_address_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("addresses (else KVFLOW_ADDR_<CHANNEL>)")
    group.add_argument("--ipc-dir", help="every channel as an ipc socket in this directory")
    for channel in ServiceAddresses.channels():
        group.add_argument(f"--addr-{channel.replace('_', '-')}", dest=f"addr_{channel}")


def resolve_addresses(args: argparse.Namespace) -> ServiceAddresses:
    """Per channel: the flag, else --ipc-dir, else the environment; all must be set."""
    base = ServiceAddresses.ipc(args.ipc_dir) if args.ipc_dir else ServiceAddresses.from_env()
    flags = {
        channel: getattr(args, f"addr_{channel}")
        for channel in ServiceAddresses.channels()
        if getattr(args, f"addr_{channel}", None)
    }
    if base is not None:
        addresses = dataclasses.replace(base, **flags)
    else:
        missing = [c for c in ServiceAddresses.channels() if c not in flags]
        if missing:
            names = ", ".join(f"--addr-{c.replace('_', '-')}" for c in missing)
            raise SystemExit(f"kvflow: no address for {names} (flags, --ipc-dir or KVFLOW_ADDR_*)")
        addresses = ServiceAddresses(**flags)
    exit_unless_tcp_allowed(
        {c: getattr(addresses, c).startswith("tcp://") for c in ServiceAddresses.channels()}
    )
    return addresses


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.create(**engine_options(args))


def _model_dir(config: EngineConfig) -> Path:
    from kvflow.gpu_worker.model_files import resolve_model_dir

    return resolve_model_dir(config.model.model)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else KVFLOW_API_KEY; None = open."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("kvflow: give --api-key or --api-key-file, not both")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"kvflow: cannot read --api-key-file: {exc}") from None
        key = lines[0] if lines else ""
    if key is None:
        key = os.environ.get("KVFLOW_API_KEY")
    if key is not None and not key.strip():
        raise SystemExit("kvflow: the API key is empty")
    return key.strip() if key is not None else None


def check_cluster_links(args: argparse.Namespace, config: EngineConfig) -> None:
    """tcp:// links of this deployment, checked before anything starts."""
    kv = config.kv_transfer.kv_transfer_config
    exit_unless_tcp_allowed(
        {
            "--distributed-executor-backend ray": args.distributed_executor_backend == "ray",
            "--data-parallel-rpc-port": bool(args.headless or args.data_parallel_rpc_port),
            "the zmq KV connector": kv is not None and kv.kv_connector == "zmq",
        }
    )


def _run_serve(args: argparse.Namespace) -> int:
    from kvflow.services.launch.launcher import ServeOptions, serve

    config = _config(args)
    check_cluster_links(args, config)
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args),
        startup_timeout_s=args.startup_timeout,
        trace_file=args.trace_file,
        restart=RestartPolicy(args.max_worker_restarts, args.worker_restart_backoff),
        api_server_count=args.api_server_count,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_address=args.ray_address,
        dp_hosts=dp_hosts(args),
        tls=resolve_tls(args),
        reasoning_parser=resolve_reasoning_parser(args),
        media=resolve_media(args),
        resend_wait_s=resolve_resend_wait(args),
    )
    return serve(config, options)


def resolve_resend_wait(args: argparse.Namespace) -> float:
    """--resend-wait, checked before anything starts."""
    if args.resend_wait < 0:
        raise SystemExit("kvflow: --resend-wait must not be negative")
    return float(args.resend_wait)


def resolve_reasoning_parser(args: argparse.Namespace) -> str | None:
    """--reasoning-parser, checked before anything starts."""
    from kvflow.errors import ConfigError
    from kvflow.services.frontend.reasoning import reasoning_parser

    try:
        reasoning_parser(args.reasoning_parser)
    except ConfigError as exc:
        raise SystemExit(f"kvflow: --reasoning-parser: {exc}") from None
    return args.reasoning_parser  # type: ignore[no-any-return]


def _run_scheduler(args: argparse.Namespace) -> int:
    from kvflow.services.scheduler.main import SchedulerOptions, run_scheduler

    config = _config(args)
    return run_scheduler(
        config,
        resolve_addresses(args),
        _model_dir(config),
        SchedulerOptions(
            trace_file=args.trace_file, worker_recovery_timeout_s=args.worker_recovery_timeout
        ),
        launcher_address=args.launcher_address,
        engine_id=args.engine_id,
    )


def _run_worker(args: argparse.Namespace) -> int:
    from kvflow.gpu_worker.main import run_worker
    from kvflow.services.launch.worker_group import check_model_split

    config = _config(args)
    model_dir = _model_dir(config)
    check_model_split(config.parallel, model_dir)  # before the group meets, not inside a rank
    return run_worker(
        config,
        resolve_addresses(args),
        args.rank,
        model_dir,
        worker_rank_init(config, args.rank, args.distributed_init_method),
        launcher_address=args.launcher_address,
    )


def worker_rank_init(config: EngineConfig, rank: int, init_method: str | None) -> RankInit | None:
    """A standalone rank's place in its group: world size T x P from the engine flags,
    the rendezvous from --distributed-init-method (None for a single rank)."""
    from kvflow.gpu_worker.distributed import RankInit
    from kvflow.services.launch.worker_group import check_parallelism

    check_parallelism(config)
    parallel = config.parallel
    world_size = parallel.world_size
    if not 0 <= rank < world_size:
        raise SystemExit(f"kvflow worker: --rank {rank} is outside the group of {world_size}")
    if world_size == 1:
        return None
    if not init_method or not init_method.startswith("tcp://"):
        # The ranks of one group meet at one address, across containers and hosts too.
        raise SystemExit(
            f"kvflow worker: a group of {world_size} ranks needs --distributed-init-method "
            f"tcp://<rank 0's host>:<port> (got {init_method!r})"
        )
    return RankInit(
        init_method,
        world_size,
        rank,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        layer_partition=parallel.layer_partition,
        expert_parallel=parallel.enable_expert_parallel,
    )


def _run_detokenizer(args: argparse.Namespace) -> int:
    from kvflow.services.detokenizer.main import run_detokenizer

    config = _config(args)
    return run_detokenizer(
        resolve_addresses(args),
        _model_dir(config),
        launcher_address=args.launcher_address,
        skip_tokenizer_init=config.model.skip_tokenizer_init,
    )


def _run_frontend(args: argparse.Namespace) -> int:
    from kvflow.routing import RoutingConfig
    from kvflow.services.frontend.main import run_frontend
    from kvflow.services.launch.launcher import ServeOptions, make_frontend_config

    config = _config(args)
    model_dir = _model_dir(config)
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args),
        tls=resolve_tls(args),
        reasoning_parser=resolve_reasoning_parser(args),
        media=resolve_media(args),
        resend_wait_s=resolve_resend_wait(args),
    )
    frontend = make_frontend_config(config, model_dir, options)
    if config.parallel.data_parallel_size == 1:
        run_frontend(frontend, resolve_addresses(args), model_dir)
        return 0
    routing = RoutingConfig(policy=config.parallel.load_balance, block_size=config.cache.block_size)
    run_frontend(frontend, _engine_addresses(args, config), model_dir, routing=routing)
    return 0


def _engine_addresses(args: argparse.Namespace, config: EngineConfig) -> list[ServiceAddresses]:
    """Engine 0's from flags or KVFLOW_ADDR_*, engine i's from KVFLOW_E<i>_ADDR_*."""
    addresses = [resolve_addresses(args)]
    for engine in range(1, config.parallel.data_parallel_size):
        found = ServiceAddresses.from_env(f"KVFLOW_E{engine}_ADDR_")
        if found is None:
            raise SystemExit(f"kvflow: no addresses for engine {engine} (KVFLOW_E{engine}_ADDR_*)")
        addresses.append(found)
    return addresses

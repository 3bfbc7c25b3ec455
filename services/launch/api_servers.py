"""`kvflow serve --api-server-count A`: A HTTP frontend processes on one port.

The launcher's own frontend is one of them; A - 1 more run in spawned processes
(`kvflow-api<i>`). Each binds the port with SO_REUSEPORT (the kernel spreads new
connections over them), links to every engine (so each sees every engine's stats and
routes by them), and has a frontend id of its own, by which the detokenizers route
outputs. Their engine health comes from the engines' messages and stats; the
launcher's process watchdog reaches only its own frontend. SIGTERM stops them
gracefully (in-flight streams may finish); they die with the launcher.

Each binds the port only once it sees every engine serve, and the launcher opens its
own (and says it is ready) only after all of them did: a connection the kernel hands
to a frontend still starting would otherwise wait, or get a 503.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

from kvflow.errors import KvflowError
from kvflow.proto.addresses import ServiceAddresses
from kvflow.routing import RoutingConfig
from kvflow.runtime.lifecycle import StopFlag, die_with_parent, set_process_name
from kvflow.services.frontend.config import FrontendConfig, new_frontend_id

logger = logging.getLogger(__name__)


_POLL_S = 0.1


@dataclasses.dataclass
class ApiServer:
    process: BaseProcess
    listening: EventType  # set once its port accepts requests


def start_api_servers(
    count: int,
    frontend: FrontendConfig,
    addresses: Sequence[ServiceAddresses],
    model_dir: Path,
    routing: RoutingConfig,
) -> list[ApiServer]:
    """Start `count` extra frontends (0 starts none)."""
    spawn = multiprocessing.get_context("spawn")
    servers: list[ApiServer] = []
    for index in range(1, count + 1):
        config = dataclasses.replace(frontend, frontend_id=new_frontend_id())
        listening = spawn.Event()
        process = spawn.Process(
            target=_api_server_main,
            args=(os.getpid(), index, logging.getLogger().level, config, list(addresses)),
            kwargs={"model_dir": model_dir, "routing": routing, "listening": listening},
            name=f"kvflow-api{index}",
        )
        process.start()
        servers.append(ApiServer(process, listening))
    return servers


def wait_api_servers(servers: list[ApiServer], timeout_s: float, stop: StopFlag) -> None:
    """Until every extra frontend listens (or `stop`); KvflowError if one exits or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while not server.listening.wait(_POLL_S) and not stop.is_set():
            if not server.process.is_alive():
                raise KvflowError(f"{server.process.name} exited ({server.process.exitcode})")
            if time.monotonic() >= deadline:
                raise KvflowError(f"{server.process.name} did not listen within {timeout_s:.0f} s")


def stop_api_servers(servers: list[ApiServer], timeout_s: float) -> None:
    processes = [server.process for server in servers]
    for process in processes:
        process.terminate()  # SIGTERM: the frontend's graceful shutdown
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            logger.warning("%s did not exit: kill", process.name)
            process.kill()
            process.join(2.0)


def _api_server_main(
    parent_pid: int,
    index: int,
    log_level: int,
    config: FrontendConfig,
    addresses: list[ServiceAddresses],
    *,
    model_dir: Path,
    routing: RoutingConfig,
    listening: EventType,
) -> None:
    from kvflow.services.frontend.main import run_frontend

    die_with_parent(parent_pid)
    set_process_name(f"kvflow-api{index}")
    logging.basicConfig(level=log_level, format=f"%(levelname)s api{index} %(name)s: %(message)s")
    run_frontend(
        config, addresses, model_dir, routing=routing, reuse_port=True, on_ready=listening.set
    )
    logging.shutdown()
    os._exit(0)

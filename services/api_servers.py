"""`kvflow serve --api-server-count A`: A HTTP frontend processes on one port.

The launcher's own frontend is one of them; A - 1 more run in spawned processes
(`kvflow-api<i>`). Each binds the port with SO_REUSEPORT (the kernel spreads new
connections over them), links to every engine (so each sees every engine's stats and
routes by them), and has a frontend id of its own, by which the detokenizers route
outputs. Their engine health comes from the engines' messages and stats; the
launcher's process watchdog reaches only its own frontend. SIGTERM stops them
gracefully (in-flight streams may finish); they die with the launcher.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.lifecycle import die_with_parent, set_process_name
from kvflow.services.frontend.config import FrontendConfig, new_frontend_id
from kvflow.services.frontend.routing import RoutingConfig

logger = logging.getLogger(__name__)


def start_api_servers(
    count: int,
    frontend: FrontendConfig,
    addresses: Sequence[ServiceAddresses],
    model_dir: Path,
    routing: RoutingConfig,
) -> list[BaseProcess]:
    """Start `count` extra frontends (0 starts none)."""
    spawn = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = []
    for index in range(1, count + 1):
        config = dataclasses.replace(frontend, frontend_id=new_frontend_id())
        process = spawn.Process(
            target=_api_server_main,
            args=(os.getpid(), index, logging.getLogger().level, config, list(addresses)),
            kwargs={"model_dir": model_dir, "routing": routing},
            name=f"kvflow-api{index}",
        )
        process.start()
        processes.append(process)
    return processes


def stop_api_servers(processes: list[BaseProcess], timeout_s: float) -> None:
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
) -> None:
    from kvflow.services.frontend.main import run_frontend

    die_with_parent(parent_pid)
    set_process_name(f"kvflow-api{index}")
    logging.basicConfig(level=log_level, format=f"%(levelname)s api{index} %(name)s: %(message)s")
    run_frontend(config, addresses, model_dir, routing=routing, reuse_port=True)
    logging.shutdown()
    os._exit(0)

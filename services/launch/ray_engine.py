"""One data-parallel engine on a Ray node: the body of the Ray actor that
`--distributed-executor-backend ray` places in the engine's placement group.

    Ray node (any host of the cluster)
      └─ EngineHost (Ray actor, holds the engine's bundle: its CPUs or GPUs)
           ├─ worker rank 0..W-1, scheduler (engine "<i>"), detokenizer   (spawned here)
           └─ supervisor thread: restarts the engine's processes when one dies

The actor is only a launcher: requests, plans and tokens travel over ZeroMQ on tcp
sockets bound on the node's address (the frontend connects to them from its host),
never through Ray. Its processes are started exactly as `kvflow serve` starts a local
engine (services/launch/data_parallel.py), with the same restart budget; they die with the
actor (PR_SET_PDEATHSIG), so a lost node or a killed actor leaves nothing behind.
Everything here imports without Ray: Ray only calls the methods.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import zmq

from kvflow.cluster_secret import INSECURE_ENV, SECRET_FILE_ENV
from kvflow.config import EngineConfig
from kvflow.runtime.cluster_auth import cluster_settings
from kvflow.runtime.lifecycle import StopFlag
from kvflow.services.launch.data_parallel import EngineGroup, Supervisor
from kvflow.services.launch.dp_hosts import free_tcp_addresses
from kvflow.services.launch.launcher import ServeOptions, _resolve_model
from kvflow.services.scheduler.main import SchedulerOptions

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineStart:
    """What the actor needs, as plain values: the config travels as MessagePack."""

    index: int
    config: bytes  # msgspec.msgpack.encode(EngineConfig)
    host: str  # the node's address that other hosts reach it by
    startup_timeout_s: float
    shutdown_timeout_s: float
    # The cluster secret's path, the same on every node (each node mounts the file;
    # it never travels through Ray), and the insecure opt-out.
    secret_file: str = ""
    insecure: bool = False


class EngineHost:
    """The actor's state: one engine's processes on this node."""

    def __init__(self, start: EngineStart) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        config = msgspec.msgpack.decode(start.config, type=EngineConfig)
        # The engine's processes inherit these (kvflow/runtime/cluster_auth.py).
        os.environ[SECRET_FILE_ENV] = start.secret_file
        os.environ[INSECURE_ENV] = "1" if start.insecure else ""
        cluster_settings()  # a node without the file fails here, naming it
        self._options = ServeOptions(
            startup_timeout_s=start.startup_timeout_s,
            shutdown_timeout_s=start.shutdown_timeout_s,
        )
        # The model is resolved on this node: a GGUF converts into this host's cache.
        model_dir = _resolve_model(config)
        self._directory = Path(tempfile.mkdtemp(prefix=f"kvflow-ray-e{start.index}-"))
        self._context = zmq.Context()
        self._group = EngineGroup(
            start.index,
            config,
            model_dir,
            self._directory,
            SchedulerOptions(),
            self._context,
            tcp=free_tcp_addresses(start.host),
        )
        self._stop = StopFlag()  # never installed: the actor's signals are Ray's
        self._supervisor = Supervisor([self._group], self._options, self._stop)

    def start(self) -> dict[str, str]:
        """Start the processes, wait for their acks; the engine's addresses."""
        self._group.start()
        assert self._group.children is not None
        self._group.children.wait_ready(self._options.startup_timeout_s, self._stop)
        self._supervisor.start()
        logger.info("engine %d ready at %s", self._group.index, self._group.addresses)
        return dataclasses.asdict(self._group.addresses)

    def death(self) -> str | None:
        """Why the engine is out of service right now (None while it serves)."""
        return self._group.death

    def stop(self) -> None:
        self._stop.set()
        self._supervisor.close()
        self._group.stop(self._options.shutdown_timeout_s)
        self._context.destroy(linger=0)
        shutil.rmtree(self._directory, ignore_errors=True)

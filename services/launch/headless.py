"""`kvflow serve --headless`: engines only, joined to a frontend on another host
(services/launch/dp_hosts.py has the protocol and the flags).

    kvflow serve --headless (this process, host B)
      ├─ engine <start rank> .. : workers, scheduler, detokenizer; sockets on tcp://B:<free>
      ├─ EngineJoin to tcp://<data-parallel-address>:<rpc port> once each engine is ready
      └─ supervisor thread: restarts a dead engine on the same ports (the frontend's
         sockets reconnect; the new incarnation puts it back into routing)

No HTTP port here. SIGINT/SIGTERM stop the engines; exit 0, or 1 if an engine could
not start or join.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import zmq

from kvflow.config import EngineConfig
from kvflow.errors import KvflowError
from kvflow.runtime.lifecycle import StopFlag
from kvflow.services.launch.data_parallel import EngineGroup, Supervisor, start_engines
from kvflow.services.launch.dp_hosts import free_tcp_addresses, join, reachable_host
from kvflow.services.launch.launcher import ServeOptions, _resolve_model
from kvflow.services.scheduler.main import SchedulerOptions

logger = logging.getLogger(__name__)


def serve_headless(config: EngineConfig, options: ServeOptions) -> int:
    """Run this host's engines until SIGINT/SIGTERM; 0 after a clean shutdown."""
    stop = StopFlag().install()
    hosts = options.dp_hosts
    size = config.parallel.data_parallel_size
    try:
        ranks = hosts.local_ranks(size)
        model_dir = _resolve_model(config)
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    host = reachable_host(hosts.address)
    base = Path(tempfile.mkdtemp(prefix="kvflow-headless-"))
    context = zmq.Context()
    groups = [
        EngineGroup(
            i,
            config,
            model_dir,
            base / f"engine{i}",
            SchedulerOptions(),
            context,
            tcp=free_tcp_addresses(host),
        )
        for i in ranks
    ]
    supervisor = Supervisor(groups, options, stop)
    try:
        start_engines(groups, options, stop)
        for group in groups:
            join(hosts, group.index, group.addresses, size, options.startup_timeout_s)
            logger.info("engine %d joined %s", group.index, hosts.join_address)
        print(f"kvflow: engines {list(ranks)} serving for {hosts.address}", flush=True)
        supervisor.start()
        while not stop.is_set():
            time.sleep(0.2)
        return 0
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    finally:
        supervisor.close()
        for group in groups:
            group.stop(options.shutdown_timeout_s)
        context.destroy(linger=0)
        shutil.rmtree(base, ignore_errors=True)

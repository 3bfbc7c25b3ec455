"""`kvflow serve --data-parallel-size D`: D engine cores behind one frontend (or
several: `--api-server-count`, services/launch/api_servers.py).

    kvflow serve (this process)
      ├─ engine 0: worker rank 0..W-1, scheduler (engine "0"), detokenizer   ipc://<dir>/engine0/*
      ├─ engine 1: ...                                                         ipc://<dir>/engine1/*
      ├─ supervisor thread: restarts an engine whose process died
      └─ frontend (HTTP) here: one link per engine, routed by --load-balance

Each engine is the whole single-engine stack with addresses of its own, its detokenizer
included: a stop string's abort goes to the one scheduler that holds the request, and a
detokenizer's death takes down one engine, not all. Processes are named
`kvflow-e<i>-sched`, `kvflow-e<i>-w<rank>`, `kvflow-e<i>-detok`.

A dead worker is restarted within `--max-worker-restarts` and the engine's scheduler
resumes its requests, as in a single engine. An engine that dies otherwise (its
scheduler or detokenizer, or a worker past its budget) is out of routing at once (its
watchdog, read by the frontend, which re-routes its requests to the other engines); its
remaining processes are stopped and the engine is started anew, up to
`RESTART_BUDGET` times. The restarted scheduler's new incarnation in its stats puts it
back into routing. Every engine must be ready before the frontend opens its port.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq

from kvflow.config import EngineConfig
from kvflow.errors import KvflowError
from kvflow.proto.addresses import ServiceAddresses
from kvflow.runtime.lifecycle import StopFlag, set_process_name
from kvflow.services.launch.children import ChildProcesses
from kvflow.services.launch.dp_hosts import await_joins
from kvflow.services.launch.launcher import (
    ServeOptions,
    _launcher_phases,
    _ready_line,
    _resolve_model,
    _TokenizerPreload,
    make_frontend_config,
)
from kvflow.services.launch.worker_group import restart_policy, worker_rank_args
from kvflow.services.scheduler.main import SchedulerOptions

logger = logging.getLogger(__name__)

RESTART_BUDGET = 3  # restarts per engine; past it the engine stays out of routing
_SUPERVISE_S = 0.2


def _named(name: str, target: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """Runs in the child: an engine-specific process name, then the role's main."""
    set_process_name(name)
    return target(*args, **kwargs)


@dataclass
class EngineGroup:
    """One engine core's processes (workers, scheduler, detokenizer) and its addresses."""

    index: int
    config: EngineConfig
    model_dir: Path
    directory: Path
    scheduler_options: SchedulerOptions
    context: zmq.Context
    children: ChildProcesses | None = None
    death: str | None = None  # set by the supervisor, read by the frontend's watchdog
    restarts: int = 0
    generation: int = 0
    tcp: ServiceAddresses | None = None  # reachable from other hosts (Ray, headless)

    @property
    def addresses(self) -> ServiceAddresses:
        """ipc sockets in `directory` when the frontend is on this host, else `tcp`."""
        return self.tcp or ServiceAddresses.ipc(str(self.directory))

    def start(self) -> None:
        from kvflow.gpu_worker.main import run_worker
        from kvflow.services.detokenizer.main import run_detokenizer
        from kvflow.services.scheduler.main import run_scheduler

        self.generation += 1
        ack = f"ipc://{self.directory}/launcher{self.generation}"
        children = self.children = ChildProcesses(self.context, ack)
        e, addresses = self.index, self.addresses
        for rank, args in enumerate(worker_rank_args(self.config, addresses, self.model_dir)):
            target = functools.partial(_named, f"kvflow-e{e}-w{rank}", run_worker)
            children.start("worker", rank, target, *args)
        scheduler = functools.partial(_named, f"kvflow-e{e}-sched", run_scheduler, engine_id=str(e))
        args = (self.config, addresses, self.model_dir, self.scheduler_options)
        children.start("scheduler", 0, scheduler, *args)
        detokenizer = functools.partial(_named, f"kvflow-e{e}-detok", run_detokenizer)
        skip = self.config.model.skip_tokenizer_init
        children.start("detokenizer", 0, detokenizer, addresses, self.model_dir, skip)

    def stop(self, timeout_s: float) -> None:
        if self.children is not None:
            self.children.shutdown(self.addresses.scheduler_input, timeout_s)
            self.children = None


class Supervisor:
    """A thread that notices a dead engine and starts it anew (within the budget)."""

    def __init__(self, groups: list[EngineGroup], options: ServeOptions, stop: StopFlag) -> None:
        self.groups = groups
        self.options = options
        self.stop = stop
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvflow-dp-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(_SUPERVISE_S):
            for group in self.groups:
                if group.children is not None and group.death is None:
                    self._check(group)

    def _check(self, group: EngineGroup) -> None:
        assert group.children is not None
        # A dead worker is restarted within its budget, as in a single engine: the
        # scheduler resumes its requests. Anything else ends the engine.
        policy = restart_policy(group.config, self.options.restart)
        fatal = group.children.supervise(policy, time.monotonic())
        if fatal is None:
            return
        death = f"engine {group.index}: {fatal}"
        group.death = death
        logger.error("%s", death)
        group.stop(self.options.shutdown_timeout_s)
        if group.restarts >= RESTART_BUDGET or self._done.is_set():
            logger.error("engine %d: restart budget spent; it stays down", group.index)
            return
        group.restarts += 1
        logger.warning("engine %d: restart %d", group.index, group.restarts)
        # The verdict ends before the new processes start: their first stats (a new
        # incarnation) put the engine back into routing, and a verdict still standing
        # then would take it out again for good.
        group.death = None
        group.start()
        try:
            assert group.children is not None
            group.children.wait_ready(self.options.startup_timeout_s, self.stop)
        except KvflowError as exc:
            logger.error("engine %d failed to restart: %s", group.index, exc)
            group.stop(self.options.shutdown_timeout_s)
            group.death = f"engine {group.index} failed to restart: {exc}"


def serve_data_parallel(config: EngineConfig, options: ServeOptions) -> int:
    """`serve()` with `data_parallel_size` engines; 0 after a clean shutdown, 1 on error."""
    start = time.monotonic()
    stop = StopFlag().install()
    phases = _launcher_phases()
    try:
        options.dp_hosts.local_ranks(config.parallel.data_parallel_size)
        model_dir = _resolve_model(config)
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="kvflow-dp-"))
    context = zmq.Context()
    scheduler_options = SchedulerOptions(startup_phases=phases.seconds)
    size = config.parallel.data_parallel_size
    groups = [
        EngineGroup(i, config, model_dir, base / f"engine{i}", scheduler_options, context)
        for i in options.dp_hosts.local_ranks(size)
    ]
    preload = _TokenizerPreload(model_dir, config.model.skip_tokenizer_init)
    supervisor = Supervisor(groups, options, stop)
    try:
        start_engines(groups, options, stop)
        logger.info("%d engines ready in %.1f s", len(groups), time.monotonic() - start)
        engines: list[RoutedEngine] = [*groups]
        if len(groups) < size:  # the others join from their hosts (kvflow serve --headless)
            engines += await_joins(options.dp_hosts, size, context, options.startup_timeout_s, stop)
        if not stop.is_set():
            supervisor.start()
            _run_frontend(config, options, engines, model_dir, preload.get(), start, stop)
            stop.install()  # the frontend's loop restored the default handlers on exit
        return 0
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    finally:
        preload.join()
        supervisor.close()
        for group in groups:
            group.stop(options.shutdown_timeout_s)
        context.destroy(linger=0)
        shutil.rmtree(base, ignore_errors=True)


def start_engines(groups: list[EngineGroup], options: ServeOptions, stop: StopFlag) -> None:
    """Start every engine at once (they load in parallel), then wait for all of them."""
    for group in groups:
        group.directory.mkdir(parents=True, exist_ok=True)
        group.start()
    for group in groups:
        assert group.children is not None
        group.children.wait_ready(options.startup_timeout_s, stop)


class RoutedEngine(Protocol):
    """What the frontend needs of an engine, wherever it runs."""

    @property
    def addresses(self) -> ServiceAddresses: ...

    @property
    def death(self) -> str | None: ...


def _run_frontend(
    config: EngineConfig,
    options: ServeOptions,
    groups: Sequence[RoutedEngine],
    model_dir: Path,
    tokenizer: Any,
    start: float,
    stop: StopFlag,
) -> None:
    from kvflow.routing import RoutingConfig
    from kvflow.services.frontend.main import run_frontend
    from kvflow.services.launch.api_servers import (
        start_api_servers,
        stop_api_servers,
        wait_api_servers,
    )

    frontend = make_frontend_config(config, model_dir, options)
    metrics_dir = None
    if options.api_server_count > 1:  # a scrape sums the request-level metrics of all
        metrics_dir = Path(tempfile.mkdtemp(prefix="kvflow-metrics-"))
        frontend = dataclasses.replace(frontend, metrics_dir=str(metrics_dir))
    routing = RoutingConfig(policy=config.parallel.load_balance, block_size=config.cache.block_size)
    addresses = [group.addresses for group in groups]
    extra = start_api_servers(options.api_server_count - 1, frontend, addresses, model_dir, routing)
    try:
        wait_api_servers(extra, options.startup_timeout_s, stop)
        run_frontend(
            frontend,
            addresses,
            model_dir,
            on_ready=_ready_line(frontend, start),
            tokenizer=tokenizer,
            routing=routing,
            engine_watchdogs=[functools.partial(_death, group) for group in groups],
            reuse_port=options.api_server_count > 1,
        )
    finally:
        stop_api_servers(extra, options.shutdown_timeout_s)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    logger.info("frontend stopped")


def _death(group: RoutedEngine) -> str | None:
    return group.death

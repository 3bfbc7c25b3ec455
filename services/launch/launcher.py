"""`kvflow serve`: the whole stack from one command.

    kvflow serve (this process) ── resolves the model once (GGUF -> safetensors cache)
      ├─ spawn: worker rank 0     ┐
      ├─ spawn: scheduler         ├─ each acks ProcessReady on ipc://<dir>/launcher
      ├─ spawn: detokenizer       ┘
      ├─ supervisor thread: restarts a dead worker (budget, backoff); any other death,
      │  or the budget spent, ends the engine: SIGTERM to this process, exit code 1
      └─ frontend (HTTP) here; its watchdog reads what the supervisor found

The channels between the roles are ipc sockets in a private temporary directory
(removed at exit). Start-up fails with a message naming the role that failed or timed
out. SIGINT/SIGTERM: the frontend stops accepting and lets in-flight streams finish
or fail, then the children get Shutdown, then SIGTERM, then SIGKILL; none outlives
this process (they also die with it: PR_SET_PDEATHSIG).

Exit codes: 0 after a clean shutdown, 1 after a start error or when the engine could
not be kept alive (a role other than the worker died, or the worker died more often
than `max_worker_restarts`): then Docker's or systemd's restart policy takes over.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from kvflow.config import EngineConfig
from kvflow.errors import KvflowError
from kvflow.heap import freeze_startup_heap
from kvflow.media import MediaOptions
from kvflow.metrics.startup_phases import StartupPhases, process_age_s
from kvflow.proto.addresses import ServiceAddresses
from kvflow.runtime.lifecycle import StopFlag
from kvflow.services.launch.children import ChildProcesses, RestartPolicy
from kvflow.services.launch.dp_hosts import DataParallelHosts
from kvflow.services.launch.worker_group import (
    check_model_split,
    check_parallelism,
    restart_policy,
    worker_rank_args,
)

if TYPE_CHECKING:
    from kvflow.services.frontend.config import FrontendConfig, TlsConfig
    from kvflow.services.scheduler.main import SchedulerOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    startup_timeout_s: float = 600.0  # model loading included
    shutdown_timeout_s: float = 10.0  # per stage: Shutdown, then SIGTERM
    trace_file: str | None = None  # the scheduler's step trace (Chrome/Perfetto JSON)
    restart: RestartPolicy = RestartPolicy()  # of a dead worker
    api_server_count: int = 1  # HTTP frontend processes on the port (SO_REUSEPORT)
    distributed_executor_backend: str = "mp"  # "ray": engines on a Ray cluster's nodes
    ray_address: str | None = None  # of the running cluster; None: `ray start`'s own
    dp_hosts: DataParallelHosts = DataParallelHosts()  # engines on other hosts (headless)
    tls: TlsConfig | None = None  # HTTPS for the API; None: plain HTTP
    reasoning_parser: str | None = None  # chat's think-tag split (frontend/reasoning.py)
    media: MediaOptions = MediaOptions()  # chat images: sources and limits (kvflow/media.py)
    resend_wait_s: float = 60.0  # a failed engine's requests wait this long for one that serves


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Run the stack until SIGINT/SIGTERM; 0 after a clean shutdown, 1 on a start error
    or when the engine died for good (see the module docstring)."""
    other_mode = _other_deployment(config, options)
    if other_mode is not None:
        return other_mode(config, options)
    start = time.monotonic()
    stop = StopFlag().install()
    phases = _launcher_phases()
    # Before any child starts: a frontend that cannot even be imported fails in a
    # second, not after the engine has loaded.
    with phases.measure("frontend_import"):
        import kvflow.services.frontend.main  # noqa: F401

    try:
        with phases.measure("model_resolve"):
            model_dir = _resolve_model(config)
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    ipc_dir = Path(tempfile.mkdtemp(prefix="kvflow-"))
    addresses = ServiceAddresses.ipc(str(ipc_dir))
    context = zmq.Context()
    children = ChildProcesses(context, f"ipc://{ipc_dir}/launcher")
    preload = _TokenizerPreload(model_dir, config.model.skip_tokenizer_init)
    from kvflow.services.scheduler.main import SchedulerOptions

    # The scheduler passes these on in its stats, with the worker's own phases.
    scheduler_options = SchedulerOptions(
        trace_file=str(Path(options.trace_file).absolute()) if options.trace_file else None,
        startup_phases=phases.seconds,
    )
    supervisor = Supervisor(children, restart_policy(config, options.restart))
    try:
        _start_children(children, config, addresses, model_dir, scheduler_options)
        _serve_when_ready(
            config, options, addresses, model_dir, children, stop, start, preload, supervisor
        )
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    finally:
        preload.join()  # never exit while a thread is importing
        supervisor.pause()
        children.shutdown(addresses.scheduler_input, options.shutdown_timeout_s)
        supervisor.stop()  # after the children: a worker it restarted dies with it
        context.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        logger.info("launcher done")
    if children.fatal is not None:
        print(f"kvflow serve: the engine died: {children.fatal}", file=sys.stderr)
        return 1
    return 0


def _other_deployment(
    config: EngineConfig, options: ServeOptions
) -> Callable[[EngineConfig, ServeOptions], int] | None:
    """The launcher of a deployment other than one local engine (Ray, headless, data
    parallel or several API servers), or None for one local engine (`serve`'s own)."""
    if options.distributed_executor_backend == "ray":
        from kvflow.services.launch.ray_executor import serve_on_ray

        return serve_on_ray
    if options.dp_hosts.headless:
        from kvflow.services.launch.headless import serve_headless

        return serve_headless
    if config.parallel.data_parallel_size > 1 or options.api_server_count > 1:
        from kvflow.services.launch.data_parallel import serve_data_parallel

        return serve_data_parallel
    return None


def _serve_when_ready(
    config: EngineConfig,
    options: ServeOptions,
    addresses: ServiceAddresses,
    model_dir: Path,
    children: ChildProcesses,
    stop: StopFlag,
    start: float,
    preload: _TokenizerPreload,
    supervisor: Supervisor,
) -> None:
    """Wait for the children's acks, then serve HTTP here until a signal."""
    from kvflow.services.frontend.main import run_frontend

    children.wait_ready(options.startup_timeout_s, stop)
    logger.info("engine ready in %.1f s", time.monotonic() - start)
    if stop.is_set():
        return
    supervisor.start()
    frontend = make_frontend_config(config, model_dir, options)
    on_ready = _ready_line(frontend, start)
    run_frontend(
        frontend,
        addresses,
        model_dir,
        children.watchdog,
        on_ready=on_ready,
        tokenizer=preload.get(),
    )
    logger.info("frontend stopped")
    stop.install()  # the frontend's loop restored the default handlers on exit


def _launcher_phases() -> StartupPhases:
    phases = StartupPhases()
    age = process_age_s()  # interpreter start and the CLI's imports, before serve()
    if age is not None:
        phases.add("launcher_process_start", age)
    return phases


def _resolve_model(config: EngineConfig) -> Path:
    """Once, here: a GGUF is converted before any child could race to convert it."""
    from kvflow.gpu_worker.model_files import resolve_model_dir

    check_parallelism(config)  # a ConfigError is a KvflowError: reported, exit 1
    try:
        model_dir = resolve_model_dir(config.model.model)
        check_model_split(config.parallel, model_dir)
        return model_dir
    except KvflowError:
        raise
    except Exception as exc:  # e.g. the disk filled up while a GGUF was converted
        # The conversion writes into a temporary directory and renames it only when
        # complete: nothing half-written is left in the cache to be loaded next time.
        raise KvflowError(
            f"could not prepare the model (a GGUF is converted into $KVFLOW_CACHE_DIR, "
            f"by default ~/.cache/kvflow): {type(exc).__name__}: {exc}"
        ) from exc


class Supervisor:
    """A thread that polls `ChildProcesses.supervise` and, once the engine cannot be
    kept alive, lets the frontend fail what is in flight with the reason (its watchdog
    polls every 0.25 s) and then stops this process as SIGTERM would.

    Workers it restarts get PR_SET_PDEATHSIG from this thread, so the thread lives
    until the children are stopped: `pause()` before `ChildProcesses.shutdown`,
    `stop()` after it."""

    POLL_S = 0.1
    FAIL_REQUESTS_S = 1.0  # the frontend's watchdog sees the reason before SIGTERM

    def __init__(self, children: ChildProcesses, policy: RestartPolicy) -> None:
        self._children = children
        self._policy = policy
        self._lock = threading.Lock()  # held while supervising; pause() takes it
        self._paused = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvflow-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.POLL_S):
            with self._lock:
                fatal = (
                    None
                    if self._paused
                    else self._children.supervise(self._policy, time.monotonic())
                )
            if fatal is not None:
                logger.error("engine dead: %s", fatal)
                time.sleep(self.FAIL_REQUESTS_S)
                os.kill(os.getpid(), signal.SIGTERM)
                self._done.wait()

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


class _TokenizerPreload:
    """The frontend's tokenizer takes seconds to import and load: do it while the
    children start, in a thread (off the critical path, which is the worker's load)."""

    def __init__(self, model_dir: Path, skip: bool = False) -> None:
        self._model_dir = model_dir
        self._skip = skip  # skip_tokenizer_init
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="kvflow-preload", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            from kvflow.tokenizer import load_tokenizer

            self._result = load_tokenizer(self._model_dir, self._skip)
        except Exception as exc:  # re-raised in the serving thread by get()
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def get(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def _start_children(
    children: ChildProcesses,
    config: EngineConfig,
    addresses: ServiceAddresses,
    model_dir: Path,
    scheduler_options: SchedulerOptions,
) -> None:
    from kvflow.gpu_worker.main import run_worker
    from kvflow.services.detokenizer.main import run_detokenizer
    from kvflow.services.scheduler.main import run_scheduler

    # The slowest to start goes first.
    for rank, args in enumerate(worker_rank_args(config, addresses, model_dir)):
        children.start("worker", rank, run_worker, *args)
    children.start("scheduler", 0, run_scheduler, config, addresses, model_dir, scheduler_options)
    skip = config.model.skip_tokenizer_init
    children.start("detokenizer", 0, run_detokenizer, addresses, model_dir, skip)


def _ready_line(frontend: FrontendConfig, start: float) -> Callable[[], None]:
    def on_ready() -> None:
        url = frontend.url
        took = time.monotonic() - start
        print(
            f"kvflow: serving {frontend.served_model_name!r} at {url} (ready in {took:.1f} s)",
            flush=True,
        )
        freeze_startup_heap()  # the frontend's loop, like every role's (kvflow/runtime/lifecycle.py)

    return on_ready


def make_frontend_config(
    config: EngineConfig, model_dir: Path, options: ServeOptions
) -> FrontendConfig:
    """The frontend's settings: its model facts are the ones the workers use."""
    from kvflow.gpu_worker.model_files import EMBEDDED_GGUF
    from kvflow.image_inputs import is_vision_model
    from kvflow.model_limits import read_model_limits
    from kvflow.pooling import engine_pooling
    from kvflow.services.frontend.config import FrontendConfig

    limits = read_model_limits(model_dir, config.model.max_model_len)
    # vLLM's default name is the --model argument as given.
    name = config.model.served_model_name or config.model.model or EMBEDDED_GGUF.split(".")[0]
    return FrontendConfig(
        served_model_name=name,
        max_model_len=limits.max_model_len,
        vocab_size=limits.vocab_size,
        host=options.host,
        port=options.port,
        api_key=options.api_key,
        model_root=config.model.model or str(model_dir),
        max_waiting_requests=config.scheduler.max_waiting_requests,
        tls=options.tls,
        reasoning_parser=options.reasoning_parser,
        pooling=engine_pooling(config.model.runner, model_dir, config.model.pooler_config),
        media=options.media,
        vision_model_dir=str(model_dir) if is_vision_model(model_dir) else None,
        lora=config.lora if config.lora.enable_lora else None,
        skip_tokenizer_init=config.model.skip_tokenizer_init,
        model_dir=str(model_dir),
        resend_wait_s=options.resend_wait_s,
    )

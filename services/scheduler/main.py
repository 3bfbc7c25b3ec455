"""The scheduler process: sockets, an input thread, start-up, and the busy loop.

    input thread (owns the PULLs)                          main thread (owns the rest)
    PULL scheduler_input  AddRequest | AbortRequests | Shutdown ─┐
    PULL worker_result    StepResult | WorkerHeartbeat | ...    ─┴▶ queue ▶ SchedulerLoop
                                           XPUB worker_plan ◀ StepPlan | Shutdown ◀┤
                                     PUSH detokenizer_input ◀ AddRequest, EngineOutputs ◀┤
                                                  PUB stats ◀ SchedulerStats | EngineDead ◀┘

Start-up: bind everything, wait for every rank's subscription to the plan socket (XPUB
shows them, so nothing is lost to PUB/SUB's slow-joiner gap), say `SchedulerHello`
with this process's random incarnation id, wait for rank 0's `WorkerInfo` answering it,
build the KV cache manager and the core, ack the launcher. The same sequence lets a
restarted scheduler (compose restarts a failed container) take over running workers:
they drop the old scheduler's requests on the hello, and frontends, seeing a new
incarnation in the stats, fail the requests that were in flight.
A lost worker (ProcessFailed, no heartbeat for `heartbeat_timeout_s`, or a dropped
connection and silence) is waited for: the loop preempts its requests and says hello
again until a (restarted) worker answers, then they resume (recovery.py). A worker that
is not back within `worker_recovery_timeout_s`, or a fatal error in the core: EngineDead
to the frontends (stats) and the detokenizer, Shutdown to the remaining workers,
ProcessFailed to the launcher, exit code 1.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvflow.config import EngineConfig
from kvflow.errors import KvflowError
from kvflow.kv_groups import group_windows_from_wire
from kvflow.metrics.roofline import ModelShape, RooflineMeter
from kvflow.pooling import engine_pooling
from kvflow.proto.addresses import ServiceAddresses, bind_address
from kvflow.proto.control import (
    PeerRefusals,
    ProcessFailed,
    WorkerHeartbeat,
    WorkerInfo,
    WorkerOutput,
)
from kvflow.proto.engine import AbortRequests, AddRequest
from kvflow.proto.frontend import EngineDead
from kvflow.proto.step import SchedulerHello, Shutdown
from kvflow.runtime.cluster_auth import REFUSAL_EVENTS, count_refused_handshake, secure_socket
from kvflow.runtime.lifecycle import LauncherLink, StopFlag, close_flushing, run_role
from kvflow.runtime.sockets import TypedSocket
from kvflow.services.scheduler.assembly import EngineShape, build_engine_core
from kvflow.services.scheduler.instruments import Instruments
from kvflow.services.scheduler.liveness import Liveness, WorkerDisconnected
from kvflow.services.scheduler.loop import Outputs, SchedulerLoop
from kvflow.services.scheduler.recovery import WORKER_RECOVERY_TIMEOUT_S, WorkerRecovery
from kvflow.services.scheduler.step_trace import StepTrace
from kvflow.tokenizer import load_tokenizer, read_eos_token_ids

logger = logging.getLogger(__name__)

# Map-like requests and the launcher's array-like Shutdown share the socket.
SchedulerInput = AddRequest | AbortRequests | Shutdown | PeerRefusals
HEARTBEAT_TIMEOUT_S = 5.0
_POLL_MS = 100


@dataclass(frozen=True)
class SchedulerOptions:
    """Settings of the scheduler process that are not engine config."""

    trace_file: str | None = None  # Chrome/Perfetto trace of the steps (step_trace.py)
    # Start-up phases measured before this process (the launcher's), passed on in the
    # stats with the worker's own.
    startup_phases: dict[str, float] = field(default_factory=dict)
    # How long a lost worker may take to come back (restart + model load) before the
    # scheduler gives up and exits 1.
    worker_recovery_timeout_s: float = WORKER_RECOVERY_TIMEOUT_S


def run_scheduler(
    config: EngineConfig,
    addresses: ServiceAddresses,
    model_dir: Path,
    options: SchedulerOptions | None = None,
    *,
    launcher_address: str | None = None,
    engine_id: str = "0",
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
) -> int:
    """Run the scheduler until Shutdown/SIGTERM (0) or a fatal error (1)."""

    options = options or SchedulerOptions()

    def body(context: zmq.Context, link: LauncherLink, stop: StopFlag) -> int:
        eos_token_ids = read_eos_token_ids(model_dir)
        instruments = _instruments(config, model_dir, options)
        sockets = _SchedulerSockets(context, addresses)
        try:
            return _serve(
                config,
                model_dir,
                sockets,
                link,
                stop,
                eos_token_ids,
                engine_id,
                heartbeat_timeout_s,
                instruments,
                options.worker_recovery_timeout_s,
            )
        finally:
            sockets.close()  # the last Shutdown / EngineDead messages are flushed
            if instruments.trace is not None:
                instruments.trace.close()  # the closing bracket: valid JSON from here on

    return run_role("scheduler", 0, launcher_address, body)


def _serve(
    config: EngineConfig,
    model_dir: Path,  # the tokenizer's: grammars compile against it
    sockets: _SchedulerSockets,
    link: LauncherLink,
    stop: StopFlag,
    eos_token_ids: frozenset[int],
    engine_id: str,
    heartbeat_timeout_s: float,
    instruments: Instruments,
    recovery_timeout_s: float,
) -> int:
    incarnation = uuid.uuid4().hex[:12]
    started = _await_workers(sockets, config.parallel.world_size, stop, incarnation)
    if started is None:
        return 0  # stopped before any worker came up
    info, early = started
    instruments.startup_phases.update(info.startup_phases)
    instruments.peak_flops, instruments.peak_bandwidth = info.peak_flops, info.peak_bandwidth
    pooling = engine_pooling(config.model.runner, model_dir, config.model.pooler_config)
    shape = EngineShape(
        info.vocab_size,
        info.max_model_len,
        info.num_blocks,
        eos_token_ids,
        pooling,
        group_windows_from_wire(info.kv_group_windows),
    )
    core = build_engine_core(
        config, shape, lambda: load_tokenizer(model_dir, config.model.skip_tokenizer_init)
    )
    ranks = range(config.parallel.world_size)
    liveness = Liveness(heartbeat_timeout_s, dict.fromkeys(ranks, time.monotonic()))
    loop = SchedulerLoop(
        core,
        sockets.outputs(),
        sockets.inbox,
        liveness,
        engine_id,
        instruments,
        incarnation=incarnation,
        recovery=WorkerRecovery(incarnation, recovery_timeout_s),
    )
    loop.worker_incarnations[0] = info.worker_incarnation
    for message in early:  # requests that raced the workers' start-up, in order
        loop.handle(message)
    link.ready(num_blocks=info.num_blocks, max_model_len=info.max_model_len)
    logger.info("scheduler %s ready: %d KV blocks", incarnation, info.num_blocks)
    return _finish(_run_loop(loop, stop), sockets, link)


def _instruments(config: EngineConfig, model_dir: Path, options: SchedulerOptions) -> Instruments:
    shape = ModelShape.try_from_model_dir(model_dir, config.model.dtype, config.model.quantization)
    trace = StepTrace(options.trace_file) if options.trace_file else None
    return Instruments(RooflineMeter(shape), trace, dict(options.startup_phases))


def _finish(reason: str | None, sockets: _SchedulerSockets, link: LauncherLink) -> int:
    """Stop the workers (and the detokenizer); after a fatal error, tell everyone."""
    if reason is None:
        logger.info("scheduler stopping")
        sockets.plans.send(Shutdown())
        sockets.detokenizer.send(Shutdown())
        return 0
    logger.error("engine dead: %s", reason)
    for sender in (sockets.stats, sockets.detokenizer):
        sender.send(EngineDead(reason))
    sockets.plans.send(Shutdown())
    link.failed(reason)
    return 1


def _run_loop(loop: SchedulerLoop, stop: StopFlag) -> str | None:
    """None after Shutdown/SIGTERM; the reason after a fatal error."""
    try:
        while not (loop.finished or stop.is_set()):
            loop.run_once()
    except Exception as exc:
        logger.exception("scheduler loop failed")
        return f"scheduler error: {type(exc).__name__}: {exc}"
    return loop.dead_reason


class EngineStartError(KvflowError):
    """A worker failed before the scheduler could start."""


def _await_workers(
    sockets: _SchedulerSockets, world_size: int, stop: StopFlag, incarnation: str
) -> tuple[WorkerInfo, list[Any]] | None:
    """Says hello once all ranks subscribed; returns rank 0's answer and the other
    messages that came meanwhile (requests racing the start-up), in order."""
    info: WorkerInfo | None = None
    early: list[Any] = []
    hello_sent = False
    while info is None:
        if stop.is_set():
            return None
        if not hello_sent and sockets.count_subscriptions() >= world_size:
            sockets.plans.send(SchedulerHello(incarnation))
            sockets.detokenizer.send(SchedulerHello(incarnation))
            hello_sent = True
        try:
            message = sockets.inbox.get(timeout=_POLL_MS / 1000)
        except queue.Empty:
            continue
        match message:
            case WorkerInfo(rank=0) if message.incarnation == incarnation:
                info = message
            case ProcessFailed(rank=rank, error=error):
                raise EngineStartError(f"worker rank {rank} failed to start: {error}")
            case Shutdown():
                return None
            case WorkerHeartbeat() | WorkerInfo() | WorkerDisconnected():
                pass
            case _:
                early.append(message)
    return info, early


class _SchedulerSockets:
    """Every socket of the scheduler, bound at construction (a busy port fails early)."""

    def __init__(self, context: zmq.Context, addresses: ServiceAddresses) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.requests = TypedSocket.open(
            context,
            zmq.PULL,
            bind_address(addresses.scheduler_input),
            bind=True,
            recv_type=SchedulerInput,
        )
        self.results = TypedSocket.open(
            context,
            zmq.PULL,
            bind_address(addresses.worker_result),
            bind=True,
            recv_type=WorkerOutput,
        )
        self.plans = _open_xpub(context, bind_address(addresses.worker_plan))
        self.stats = TypedSocket.open(context, zmq.PUB, bind_address(addresses.stats), bind=True)
        self.detokenizer = TypedSocket.open(
            context, zmq.PUSH, addresses.detokenizer_input, bind=False
        )
        self._subscriptions = 0
        self._stop_reader = threading.Event()
        self._reader = threading.Thread(target=self._read, name="scheduler-input", daemon=True)
        self._reader.start()

    def outputs(self) -> Outputs:
        return Outputs(plans=self.plans, detokenizer=self.detokenizer, stats=self.stats)

    def count_subscriptions(self) -> int:
        """Subscriptions seen on the plan socket so far (one per connected worker)."""
        while self.plans.socket.poll(0, zmq.POLLIN):
            if self.plans.socket.recv()[:1] == b"\x01":
                self._subscriptions += 1
        return self._subscriptions

    def _read(self) -> None:
        """Input thread: decode every frame of both PULL sockets into the inbox, and
        turn a dropped worker connection into WorkerDisconnected (a fast death hint)."""
        # This monitor replaces the cluster guard's on the result socket, so it counts
        # the refused peers itself; their disconnects are not a worker's.
        monitor = self.results.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | REFUSAL_EVENTS)
        poller = zmq.Poller()
        for socket in (self.requests.socket, self.results.socket, monitor):
            poller.register(socket, zmq.POLLIN)
        refused = 0  # failed handshakes whose disconnect is still to come
        while not self._stop_reader.is_set():
            for socket, _ in poller.poll(_POLL_MS):
                if socket is monitor:
                    event = recv_monitor_message(monitor)["event"]
                    if event != zmq.EVENT_DISCONNECTED:
                        count_refused_handshake(event, str(self.results.socket.LAST_ENDPOINT))
                        refused += 1
                    elif refused:
                        refused -= 1
                    else:
                        self.inbox.put(WorkerDisconnected())
                else:
                    self._read_all(
                        self.requests if socket is self.requests.socket else self.results
                    )
        self.results.socket.disable_monitor()
        monitor.close(linger=0)

    def _read_all(self, typed: TypedSocket[Any]) -> None:
        while True:
            try:
                message = typed.recv(timeout_ms=0)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped a malformed message: %s", exc)
                continue
            if message is None:
                return
            self.inbox.put(message)

    def close(self) -> None:
        self._stop_reader.set()
        self._reader.join(timeout=1.0)
        for typed in (self.requests, self.results):
            typed.close()  # the reader's sockets: nothing to flush
        for typed in (self.plans, self.detokenizer, self.stats):
            close_flushing(typed)


def _open_xpub(context: zmq.Context, address: str) -> TypedSocket[Any]:
    """A PUB that also reports subscriptions (verbose: one per subscriber, not per topic)."""
    socket = context.socket(zmq.XPUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # before bind: no subscription slips past
    socket.bind(secure_socket(socket, address, bind=True))
    return TypedSocket(socket)

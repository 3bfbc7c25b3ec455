"""The worker process: the socket shell around `ModelRunner`, one process per rank.

    SUB  worker_plan    StepPlan | SchedulerHello | Shutdown
    PUSH worker_result  WorkerInfo (rank 0, answering each SchedulerHello), StepResult
                        (tensor-parallel rank 0 of the last pipeline stage only: the
                        other ranks compute the same step and hold no extra answer),
                        WorkerHeartbeat (every rank, 1/s, from a side thread with its
                        own socket), ProcessFailed

The plan socket is connected first, before the model loads: the scheduler says
SchedulerHello once it sees every rank subscribed, and the hello waits in the socket
until the model is ready to answer it. A scheduler that restarts says hello again to
the same workers (ZeroMQ reconnects them): they drop the old scheduler's requests and
rank 0 answers with WorkerInfo as at start-up. Each worker process has a random
incarnation id, sent in its heartbeats and WorkerInfo: a scheduler that hears a new id
for a rank knows the worker it planned for was replaced (a restart), even before it
missed a heartbeat, and recovers (services/scheduler/recovery.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from kvflow.config import EngineConfig
from kvflow.gpu_worker.distributed import RankInit
from kvflow.gpu_worker.runner_factory import build_runner
from kvflow.heap import keep_freed_memory
from kvflow.metrics.startup_phases import StartupPhases, process_age_s
from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.control import ProcessFailed, WorkerHeartbeat, WorkerInfo
from kvflow.proto.step import SchedulerHello, Shutdown, StepPlan, WorkerInput
from kvflow.runtime.cluster_auth import REFUSALS
from kvflow.runtime.lifecycle import LauncherLink, StopFlag, close_flushing, run_role
from kvflow.runtime.sockets import TypedSocket

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
_POLL_MS = 200


def run_worker(
    config: EngineConfig,
    addresses: ServiceAddresses,
    rank: int,
    model_dir: Path,
    rank_init: RankInit | None = None,
    *,
    launcher_address: str | None = None,
) -> int:
    """Run one rank until Shutdown/SIGTERM (0) or an error (ProcessFailed, then 1).
    With `rank_init` the rank joins its tensor-parallel group (gpu_worker/distributed.py)
    before it builds the model."""

    incarnation = uuid.uuid4().hex[:12]

    def body(context: zmq.Context, link: LauncherLink, stop: StopFlag) -> int:
        plans = TypedSocket.open(
            context,
            zmq.SUB,
            addresses.worker_plan,
            bind=False,
            recv_type=WorkerInput,
            subscribe=b"",
        )
        results = TypedSocket.open(context, zmq.PUSH, addresses.worker_result, bind=False)
        heartbeat = _Heartbeat(context, addresses.worker_result, rank, incarnation)
        try:
            from kvflow.gpu_worker.distributed import rank_group

            with rank_group(rank_init, config.device.device):
                return _serve(config, rank, model_dir, plans, results, link, stop, incarnation)
        except Exception as exc:
            # The scheduler hears it on its own channel at once (not after 5 s of silence).
            results.send(ProcessFailed("worker", rank, f"{type(exc).__name__}: {exc}"))
            close_flushing(results)
            raise
        finally:
            heartbeat.stop()

    return run_role("worker", rank, launcher_address, body)


def _serve(
    config: EngineConfig,
    rank: int,
    model_dir: Path,
    plans: TypedSocket[Any],
    results: TypedSocket[Any],
    link: LauncherLink,
    stop: StopFlag,
    incarnation: str,
) -> int:
    start = time.perf_counter()
    keep_freed_memory()
    phases = StartupPhases()
    age = process_age_s()
    if age is not None:
        phases.add("worker_process_start", age)
    built = build_runner(config, model_dir, config.parallel.world_size, phases, measure_peaks=True)
    runner, max_model_len, peaks = built.runner, built.max_model_len, built.peaks
    assert peaks is not None  # measure_peaks
    answers = _answers_steps()
    load_s = time.perf_counter() - start
    link.ready(num_blocks=runner.num_blocks, load_s=round(load_s, 3))
    logger.info("worker rank %d ready in %.1f s: %d KV blocks", rank, load_s, runner.num_blocks)
    while not stop.is_set():
        message = plans.recv(timeout_ms=_POLL_MS)
        match message:
            case StepPlan():  # every rank runs every plan
                result = runner.execute(message)
                if answers:
                    results.send(result)
            case SchedulerHello(leave=leave) if incarnation in leave:
                # Exit non-zero, so that the restart policy starts this rank again.
                logger.warning("worker rank %d: its group lost a rank; leaving it", rank)
                return 1
            case SchedulerHello(incarnation=hello_id):
                runner.drop_all_requests()
                logger.info("worker rank %d: hello from scheduler %s", rank, hello_id)
                if rank == 0:
                    results.send(
                        WorkerInfo(
                            rank,
                            runner.num_blocks,
                            runner.vocab_size,
                            max_model_len,
                            startup_phases=phases.seconds,
                            peak_flops=peaks.flops,
                            peak_bandwidth=peaks.bandwidth,
                            incarnation=hello_id,
                            worker_incarnation=incarnation,
                            kv_group_windows=runner.kv_layout.wire_windows,
                        )
                    )
            case Shutdown():
                return 0
    return 0


def _answers_steps() -> bool:
    """Whether this rank sends StepResults: TP rank 0 of the last pipeline stage (the
    stage that samples). Called inside the rank's groups."""
    from kvflow.gpu_worker.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().is_last and get_tp_group().rank == 0


class _Heartbeat:
    """A daemon thread that PUSHes WorkerHeartbeat every second on its own socket."""

    def __init__(self, context: zmq.Context, address: str, rank: int, incarnation: str) -> None:
        self._socket = TypedSocket.open(context, zmq.PUSH, address, bind=False)
        self._rank = rank
        self._incarnation = incarnation
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            beat = WorkerHeartbeat(self._rank, time.time(), self._incarnation, REFUSALS.count)
            self._socket.send(beat)
            if self._stopped.wait(HEARTBEAT_INTERVAL_S):
                break
        self._socket.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)

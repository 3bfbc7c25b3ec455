"""The offline engine's runner when the model spans several worker processes.

`LLM(tensor_parallel_size=T, pipeline_parallel_size=P)` cannot run T x P ranks in its
own process (each rank is a torch.distributed process), so it starts the same worker
processes `kvflow serve` starts, and drives them over the same sockets the scheduler uses:

    LLMEngine ── StepPlan (XPUB, every rank) ──▶ worker rank 0..TP-1
              ◀── StepResult (PULL, TP rank 0 of the last stage) ───┘

It is a `StepExecutor` (gpu_worker/executor.py): `submit(plan)` sends a plan and
returns at once and `result()` awaits the oldest submitted plan's result, so the engine
keeps several steps in flight (P micro-batches fill the pipeline). The engine core, and
therefore every scheduling rule, is the one the offline path always runs. After a step
failed in the engine, `drop_all_requests()` waits out the steps in flight and says
hello again: every rank drops its batch at the same point of the plan stream, as for a
restarted scheduler, and the group serves on. A rank that fails or dies raises
EngineDeadError at once (the next or current step); `close()` (also at interpreter
exit) stops the ranks and leaves no process behind.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import zmq

from kvflow.config import EngineConfig
from kvflow.errors import EngineDeadError
from kvflow.kv_groups import group_windows_from_wire
from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.control import ProcessFailed, WorkerInfo, WorkerOutput
from kvflow.proto.step import SchedulerHello, Shutdown, StepPlan, StepResult
from kvflow.runtime.cluster_auth import secure_socket
from kvflow.runtime.lifecycle import StopFlag
from kvflow.runtime.sockets import TypedSocket
from kvflow.services.launch.children import ChildProcesses
from kvflow.services.launch.worker_group import worker_rank_args

logger = logging.getLogger(__name__)

_POLL_MS = 100
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0


class WorkerGroupRunner:
    """Worker processes of one engine, seen as one StepExecutor."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.world_size = config.parallel.world_size
        self._dir = Path(tempfile.mkdtemp(prefix="kvflow-llm-"))
        self._addresses = ServiceAddresses.ipc(str(self._dir))
        self._context = zmq.Context()
        self._plans = _open_xpub(self._context, self._addresses.worker_plan)
        self._results = TypedSocket.open(
            self._context,
            zmq.PULL,
            self._addresses.worker_result,
            bind=True,
            recv_type=WorkerOutput,
        )
        self._children = ChildProcesses(self._context, f"ipc://{self._dir}/launcher")
        self._closed = False
        self._submitted: deque[int] = deque()  # step ids whose results are awaited
        atexit.register(self.close)
        try:
            from kvflow.gpu_worker.main import run_worker

            for rank, args in enumerate(worker_rank_args(config, self._addresses, model_dir)):
                self._children.start("worker", rank, run_worker, *args)
            info = self._await_info()
        except BaseException:
            self.close()
            raise
        self.num_blocks = info.num_blocks
        self.kv_group_windows = group_windows_from_wire(info.kv_group_windows)
        self.vocab_size = info.vocab_size

    def _await_info(self) -> WorkerInfo:
        """Hello once every rank subscribed to the plans; rank 0's answer."""
        self._children.wait_ready(STARTUP_TIMEOUT_S, StopFlag())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        subscriptions = 0
        while subscriptions < self.world_size:
            if self._plans.socket.poll(_POLL_MS, zmq.POLLIN):
                subscriptions += self._plans.socket.recv()[:1] == b"\x01"
            self._check_alive(deadline)
        return self._hello(deadline)

    def _hello(self, deadline: float) -> WorkerInfo:
        """SchedulerHello to every rank (each drops its requests); rank 0's answer."""
        incarnation = uuid.uuid4().hex[:12]
        self._plans.send(SchedulerHello(incarnation))
        while True:
            message = self._recv(deadline)
            if isinstance(message, WorkerInfo) and message.incarnation == incarnation:
                return message

    def submit(self, plan: StepPlan) -> None:
        """Send one step to every rank; its result comes from `result()`, in order."""
        if self._closed:
            raise EngineDeadError("the engine's workers were stopped")
        self._plans.send(plan)
        self._submitted.append(plan.step_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._submitted)

    def result(self) -> StepResult:
        """The result of the oldest step submitted and not yet returned."""
        step_id = self._submitted[0]
        while True:
            message = self._recv(None)
            if isinstance(message, StepResult) and message.step_id == step_id:
                self._submitted.popleft()
                return message

    def _recv(self, deadline: float | None) -> Any:
        """The next message from a rank; EngineDeadError if one failed or exited."""
        while True:
            message = self._results.recv(timeout_ms=_POLL_MS)
            if isinstance(message, ProcessFailed):
                raise EngineDeadError(f"worker rank {message.rank} failed: {message.error}")
            if message is not None:
                return message
            self._check_alive(deadline)

    def _check_alive(self, deadline: float | None) -> None:
        if self._closed:
            raise EngineDeadError("the engine's workers were stopped")
        for child in self._children.children:
            if not child.process.is_alive():
                raise EngineDeadError(f"the engine died: {child.exit_description()}")
        if deadline is not None and time.monotonic() > deadline:
            raise EngineDeadError(f"workers did not answer within {STARTUP_TIMEOUT_S:g} s")

    def drop_all_requests(self) -> None:
        """After a failed step: the steps in flight finish on every rank (their results
        are dropped), then a hello makes every rank drop its batch at the same point of
        the plan stream. A group that cannot (a rank died) is stopped: the engine is dead."""
        if self._closed:
            return
        try:
            while self._submitted:
                self.result()
            self._hello(time.monotonic() + STARTUP_TIMEOUT_S)
        except EngineDeadError as exc:
            logger.error("worker group lost after a failed step: %s", exc)
            self.close()

    def close(self) -> None:
        """Shutdown to every rank, then SIGTERM/SIGKILL whoever is still there."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._plans.send(Shutdown())
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for child in self._children.children:
            child.process.join(max(0.0, deadline - time.monotonic()))
        self._children.shutdown(self._addresses.scheduler_input, SHUTDOWN_TIMEOUT_S)
        self._plans.close()
        self._results.close()
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _open_xpub(context: zmq.Context, address: str) -> TypedSocket[Any]:
    """A PUB that reports each subscriber (verbose), so the hello waits for every rank."""
    socket = context.socket(zmq.XPUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.XPUB_VERBOSE, 1)
    socket.bind(secure_socket(socket, address, bind=True))
    return TypedSocket(socket)

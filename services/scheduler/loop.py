"""The scheduler's busy loop: queue in, plans / deltas / stats out. No socket reads here.

One step is in flight at a time. While it runs, the loop keeps taking requests and
aborts from the inbox (an abort frees its blocks at once: nothing reuses them before the
in-flight step's result is back, because the next plan is only made after it). The loop
blocks on the inbox only when no step can be planned: idle, or a result is awaited.

    inbox ─▶ AddRequest ─▶ forward to detokenizer ─▶ admit ─▶ core.add_request
                                                         └▶ error TokenDelta
          ─▶ AbortRequests ─▶ core.finish_requests ─▶ "abort" TokenDelta
          ─▶ StepResult ─▶ core.update_from_output ─▶ EngineOutputs ─▶ detokenizer
    no step in flight and work left ─▶ core.schedule ─▶ StepPlan ─▶ workers
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.proto.control import ProcessFailed, WorkerHeartbeat, WorkerInfo
from kvflow.proto.engine import AbortRequests, AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.stats import SchedulerStats
from kvflow.proto.step import Shutdown, StepPlan, StepResult
from kvflow.roofline import RooflineMeter, StepBatch
from kvflow.services.scheduler.admission import EngineLimits, admit
from kvflow.services.scheduler.liveness import Liveness, WorkerDisconnected
from kvflow.services.scheduler.request import RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.step_trace import StepSample, StepTrace

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5  # also the frontends' heartbeat of this engine
INTEGRITY_INTERVAL_S = 1.0
_MAX_DRAIN = 4096  # messages handled between two steps at most


class Sender(Protocol):
    def send(self, message: msgspec.Struct, *, to: bytes | None = None) -> None: ...


@dataclass
class Outputs:
    """Where the loop writes (all owned by the loop's thread)."""

    plans: Sender  # PUB worker_plan
    detokenizer: Sender  # PUSH detokenizer_input
    stats: Sender  # PUB stats


@dataclass
class _Counters:
    """Cumulative token and step counts for SchedulerStats."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    step_tokens: list[int] = field(default_factory=list)  # since the last stats message
    started: set[str] = field(default_factory=set)  # requests with a first token

    def on_step(self, plan: StepPlan, deltas: list[TokenDelta]) -> None:
        if plan.scheduled_req_ids:
            self.num_steps += 1
            self.step_tokens.append(plan.total_num_scheduled_tokens)
        for delta in deltas:
            self.num_generation_tokens += len(delta.new_token_ids)
            if delta.req_id not in self.started:
                self.started.add(delta.req_id)
                self.num_prompt_tokens += delta.num_prompt_tokens
            if delta.finish_reason is not None:
                self.started.discard(delta.req_id)


@dataclass
class Instruments:
    """What the loop measures besides tokens: estimated work per step phase, an optional
    step trace, and start-up facts it only passes on in its stats."""

    roofline: RooflineMeter = field(default_factory=lambda: RooflineMeter(None))
    trace: StepTrace | None = None
    startup_phases: dict[str, float] = field(default_factory=dict)
    peak_flops: float = 0.0  # FLOP/s, 0 = unknown
    peak_bandwidth: float = 0.0  # bytes/s, 0 = unknown


class SchedulerLoop:
    def __init__(
        self,
        core: Scheduler,
        limits: EngineLimits,
        outputs: Outputs,
        inbox: queue.Queue[Any],
        liveness: Liveness,
        engine_id: str = "0",
        instruments: Instruments | None = None,
        incarnation: str = "",
    ) -> None:
        self.core = core
        self.limits = limits
        self.outputs = outputs
        self.inbox = inbox
        self.liveness = liveness
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.pending: StepPlan | None = None  # the plan whose result is awaited
        self.owners: dict[str, str] = {}  # live req_id -> frontend_id
        self.counters = _Counters()
        self.instruments = instruments or Instruments()
        self._step_batch = StepBatch([], [], 0, 0)  # of the pending plan
        self._step_started = 0.0  # perf_counter() when the pending plan was sent
        self.dead_reason: str | None = None
        self.shutdown_requested = False
        self._stalled = False  # the last plan was empty: wait for a message, do not spin
        self._next_stats = 0.0
        self._next_integrity = 0.0

    # ---- the loop ----------------------------------------------------------------

    def run_once(self) -> None:
        """Take what arrived (blocking only when nothing can be planned), then step."""
        self._drain(self._wait_timeout(time.monotonic()))
        if self._can_plan() and not self._stalled and not self.finished:
            self._start_step()
        self._housekeeping(time.monotonic())

    @property
    def finished(self) -> bool:
        return self.shutdown_requested or self.dead_reason is not None

    def _can_plan(self) -> bool:
        return self.pending is None and self.core.has_unfinished_requests()

    def _wait_timeout(self, now: float) -> float:
        if self._can_plan() and not self._stalled:
            return 0.0
        return min(max(self._next_stats - now, 0.0), STATS_INTERVAL_S)

    def _drain(self, timeout: float) -> None:
        try:
            message = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        self._stalled = False
        self.handle(message)
        for _ in range(_MAX_DRAIN):
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.handle(message)

    def handle(self, message: Any) -> None:
        """Apply one inbox message (the loop calls this for everything it drains)."""
        now = time.monotonic()
        match message:
            case AddRequest():
                self._add(message)
            case AbortRequests():
                self._abort(message)
            case StepResult():
                self.liveness.beat(0, now)
                self._finish_step(message)
            case WorkerHeartbeat(rank=rank):
                self.liveness.beat(rank, now)
            case ProcessFailed(rank=rank, error=error):
                self.dead_reason = f"worker rank {rank} failed: {error}"
            case WorkerInfo(rank=rank):
                # Only a SchedulerHello asks for one, and it is sent once, at start-up.
                logger.warning("unexpected WorkerInfo from worker rank %d: ignored", rank)
            case WorkerDisconnected():
                self.liveness.suspect(now)
            case Shutdown():
                self.shutdown_requested = True
            case _:
                logger.error("unexpected message %r", type(message).__name__)

    # ---- requests ----------------------------------------------------------------

    def _add(self, message: AddRequest) -> None:
        if message.req_id in self.owners:
            logger.error("duplicate request id %r: dropped", message.req_id)
            return
        # First, on the same socket as the deltas: the detokenizer knows every request
        # before any of its outputs, including the error below.
        self.outputs.detokenizer.send(message)
        try:
            request = admit(message, self.limits, queued_time=time.time())
        except Exception as exc:
            if not isinstance(exc, InvalidRequestError):
                logger.exception("admitting request %s failed", message.req_id)
            error = TokenDelta(
                message.req_id,
                [],
                finish_reason="error",
                num_prompt_tokens=len(message.prompt_token_ids),
                frontend_id=message.frontend_id,
                error=str(exc),
            )
            self._send_deltas([error])
            return
        self.owners[message.req_id] = message.frontend_id
        self.core.add_request(request)

    def _abort(self, message: AbortRequests) -> None:
        stopped = message.finish_reason == "stop"
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        deltas = []
        for request in self.core.finish_requests(message.req_ids, status):
            frontend_id = self.owners.pop(request.request_id, "")
            self.counters.started.discard(request.request_id)
            if not stopped:  # a stop string was already final at the detokenizer
                deltas.append(
                    TokenDelta(
                        request.request_id,
                        [],
                        finish_reason="abort",
                        num_prompt_tokens=request.num_prompt_tokens,
                        frontend_id=frontend_id,
                    )
                )
        self._send_deltas(deltas)

    # ---- steps -------------------------------------------------------------------

    def _start_step(self) -> None:
        plan = self.core.schedule(now=time.time())
        if not plan.scheduled_req_ids and not plan.finished_req_ids:
            self._stalled = True
            return
        self.outputs.plans.send(plan)
        self.pending = plan
        self._step_started = time.perf_counter()
        self._step_batch = StepBatch.from_plan(plan, self.core.requests)

    def _finish_step(self, result: StepResult) -> None:
        plan = self.pending
        if plan is None or result.step_id != plan.step_id:
            logger.error("result of step %d was not awaited: dropped", result.step_id)
            return
        self.pending = None
        if self._step_batch.num_tokens:
            self._measure_step(plan, time.perf_counter() - self._step_started)
        deltas = self.core.update_from_output(plan, result, now=time.time())
        self.counters.on_step(plan, deltas)
        for delta in deltas:
            if delta.finish_reason is None:
                delta.frontend_id = self.owners.get(delta.req_id, "")
            else:
                delta.frontend_id = self.owners.pop(delta.req_id, "")
        self._send_deltas(deltas)

    def _measure_step(self, plan: StepPlan, seconds: float) -> None:
        """Roofline totals always; the trace (before finished requests free their
        blocks, so KV usage is the step's own) only when it is on."""
        cost = self.instruments.roofline.record(self._step_batch, seconds)
        if self.instruments.trace is not None:
            sample = StepSample(
                step_id=plan.step_id,
                start_s=time.time() - seconds,
                duration_s=seconds,
                batch=self._step_batch,
                cost=cost,
                num_running=len(self.core.running),
                num_waiting=len(self.core.waiting),
                kv_cache_usage=self.core.kv_cache.usage,
                num_preemptions=self.core.num_preemptions,
            )
            self.instruments.trace.record_step(sample)

    def _send_deltas(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self.outputs.detokenizer.send(EngineOutputs(deltas, time.time()))

    # ---- periodic work -----------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        if now >= self._next_stats:
            self._next_stats = now + STATS_INTERVAL_S
            self.outputs.stats.send(self.stats_message())
            if self.instruments.trace is not None:
                self.instruments.trace.flush()  # a live trace file lags by 0.5 s at most
        if self.dead_reason is None:
            self.dead_reason = self.liveness.dead_reason(now)
        idle = self.pending is None and not self.core.has_unfinished_requests()
        if idle and now >= self._next_integrity:
            self._next_integrity = now + INTEGRITY_INTERVAL_S
            self.core.kv_cache.check_integrity()

    def stats_message(self) -> SchedulerStats:
        stats = self.core.stats()
        counters = self.counters
        step_tokens, counters.step_tokens = counters.step_tokens, []
        instruments = self.instruments
        return SchedulerStats(
            timestamp=time.time(),
            engine=self.engine_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            num_prompt_tokens=counters.num_prompt_tokens,
            num_generation_tokens=counters.num_generation_tokens,
            num_steps=counters.num_steps,
            step_tokens=step_tokens,
            # Copies: the meter keeps counting while an in-process receiver holds these.
            roofline={
                k: msgspec.structs.replace(v) for k, v in instruments.roofline.phases.items()
            },
            peak_flops=instruments.peak_flops,
            peak_bandwidth=instruments.peak_bandwidth,
            startup_phases=instruments.startup_phases,
            incarnation=self.incarnation,
        )

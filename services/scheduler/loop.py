"""The scheduler's busy loop: queue in, plans / deltas / stats out. No socket reads here.

The loop is the served transport of `EngineCore` (engine_core.py), which holds every
rule; the offline `LLM` drives the same core in process. Up to `max_steps_in_flight`
plans await their results (1, or 2 with async scheduling). While they run, the loop
keeps taking requests and aborts from the inbox: an abort frees its blocks at once,
and a later plan may hand them out again, which is safe because the worker runs plans
in order (the in-flight step writes them before the later one does). The loop blocks on
the inbox only when no step can be planned: idle, or every slot is awaiting a result.

    inbox ─▶ AddRequest ─▶ forward to detokenizer ─▶ core.add_request
                                                  └▶ (rejected) error TokenDelta
          ─▶ AbortRequests ─▶ core.abort_requests ─▶ "abort" TokenDelta
          ─▶ StepResult ─▶ core.update ─▶ EngineOutputs ─▶ detokenizer
    a slot free and work left ─▶ core.schedule ─▶ StepPlan ─▶ workers

A lost worker (it failed, went silent or dropped its connection) does not end the
loop: the steps in flight are dropped, the running requests are preempted, and no step
is planned until a worker answers a new hello (recovery.py); then they resume by
recomputation and their streams go on where they stopped.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.proto.control import PeerRefusals, ProcessFailed, WorkerHeartbeat, WorkerInfo
from kvflow.proto.engine import (
    DETOKENIZER_PROMPT_TAIL,
    AbortRequests,
    AddRequest,
    EngineOutputs,
    TokenDelta,
)
from kvflow.proto.stats import SchedulerStats
from kvflow.proto.step import SchedulerHello, Shutdown, StepResult
from kvflow.services.scheduler.block_map import block_map
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.instruments import Instruments
from kvflow.services.scheduler.liveness import EngineRefusals, Liveness, WorkerDisconnected
from kvflow.services.scheduler.recovery import WorkerRecovery
from kvflow.services.scheduler.spec_decode.speculator import spec_decode_stats

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5  # also the frontends' heartbeat of this engine
GRAMMAR_POLL_S = 0.002  # how often an idle loop looks for finished grammar compiles
INTEGRITY_INTERVAL_S = 1.0
# The idle self-check walks every block (~0.5 us each): above this many blocks one walk
# would delay a request that arrives meanwhile by more than ~50 ms, so it is skipped
# (the unit and integration tests run the check directly, on pools of every size).
IDLE_INTEGRITY_MAX_BLOCKS = 65_536
_MAX_DRAIN = 4096  # messages handled between two steps at most


class Sender(Protocol):
    def send(self, message: msgspec.Struct, *, to: bytes | None = None) -> None: ...


@dataclass
class Outputs:
    """Where the loop writes (all owned by the loop's thread)."""

    plans: Sender  # PUB worker_plan
    detokenizer: Sender  # PUSH detokenizer_input
    stats: Sender  # PUB stats


class SchedulerLoop:
    def __init__(
        self,
        core: EngineCore,
        outputs: Outputs,
        inbox: queue.Queue[Any],
        liveness: Liveness,
        engine_id: str = "0",
        instruments: Instruments | None = None,
        incarnation: str = "",
        recovery: WorkerRecovery | None = None,
    ) -> None:
        self.core = core
        self.outputs = outputs
        self.inbox = inbox
        self.liveness = liveness
        self.refusals = EngineRefusals()
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.instruments = instruments or Instruments()
        self.recovery = recovery or WorkerRecovery(incarnation)
        # rank -> random id of the worker process that answered the latest hello
        self.worker_incarnations: dict[int, str] = {}
        # perf_counter() when the worker could start the oldest step in flight: when it
        # was sent, or when the step before it came back, whichever was later.
        self._step_started = 0.0
        self.dead_reason: str | None = None
        self.shutdown_requested = False
        self._stalled = False  # the last plan was empty: wait for a message, do not spin
        self._next_stats = 0.0
        self._next_integrity = 0.0

    # ---- the loop ----------------------------------------------------------------

    def run_once(self) -> None:
        """Take what arrived (blocking only when nothing can be planned), then step."""
        self._drain(self._wait_timeout(time.monotonic()))
        self._poll_grammars()
        while self._can_plan() and not self._stalled and not self.finished:
            self._start_step()
        self._housekeeping(time.monotonic())

    @property
    def finished(self) -> bool:
        return self.shutdown_requested or self.dead_reason is not None

    def _can_plan(self) -> bool:
        return not self.recovery.recovering and self.core.can_schedule()

    def _wait_timeout(self, now: float) -> float:
        if self._can_plan() and not self._stalled:
            return 0.0
        if self.core.waiting_for_grammar:  # compiles finish off the inbox: look again soon
            return GRAMMAR_POLL_S
        if self.core.holds_admission:  # the hold ends by the clock too: plan again soon
            self._stalled = False
            return GRAMMAR_POLL_S
        return min(max(self._next_stats - now, 0.0), STATS_INTERVAL_S)

    def _poll_grammars(self) -> None:
        if not self.core.waiting_for_grammar:
            return
        waiting = len(self.core.waiting_for_grammar)
        self._send_deltas(self.core.poll_grammars(time.time()))
        if len(self.core.waiting_for_grammar) < waiting:
            self._stalled = False  # a compiled request may be planned now

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
            case StepResult() if self.recovery.recovering:
                logger.info("result of step %d from a lost worker: ignored", message.step_id)
            case StepResult():
                self.liveness.beat(0, now)
                self._finish_step(message)
            case WorkerHeartbeat(rank=rank, incarnation=worker):
                self.liveness.beat(rank, now)
                self.refusals.workers[rank] = message.auth_failures
                self._check_incarnation(rank, worker, now)
                if self.recovery.rank_restarted(rank, worker) and not self.recovery.recovering:
                    self._worker_lost(f"worker rank {rank} was restarted (a new process)", now)
            case ProcessFailed(rank=rank, error=error):
                self._worker_lost(f"worker rank {rank} failed: {error}", now)
            case WorkerInfo(rank=0) if self.recovery.answers(message.incarnation):
                self._worker_back(message, now)
            case WorkerInfo(rank=rank):
                logger.debug("WorkerInfo from worker rank %d for another hello: ignored", rank)
            case PeerRefusals(role=role, count=count):
                self.refusals.others[role] = count
            case WorkerDisconnected():
                self.liveness.suspect(now)
            case Shutdown():
                self.shutdown_requested = True
            case _:
                logger.error("unexpected message %r", type(message).__name__)

    # ---- requests ----------------------------------------------------------------

    def _add(self, message: AddRequest) -> None:
        if message.req_id in self.core.owners:
            logger.error("duplicate request id %r: dropped", message.req_id)
            return
        # First, on the same socket as the deltas: the detokenizer knows every request
        # before any of its outputs, including the error below. It reads only the
        # prompt's tail, so that is all that crosses this socket.
        tail = message.prompt_token_ids[-DETOKENIZER_PROMPT_TAIL:]
        self.outputs.detokenizer.send(msgspec.structs.replace(message, prompt_token_ids=tail))
        try:
            self.core.add_request(message, now=time.time())
        except Exception as exc:
            if not isinstance(exc, InvalidRequestError):
                logger.exception("admitting request %s failed", message.req_id)
            delta = self.core.error_delta(message, str(exc))
            if isinstance(exc, InvalidRequestError) and exc.param is not None:
                delta.error_param = exc.param  # the request's own fault: a 400
            self._send_deltas([delta])

    def _abort(self, message: AbortRequests) -> None:
        self._send_deltas(self.core.abort_requests(message.req_ids, message.finish_reason))

    # ---- steps -------------------------------------------------------------------

    def _start_step(self) -> None:
        plan = self.core.schedule(now=time.time())
        if plan is None:
            self._stalled = True
            return
        self.outputs.plans.send(plan)
        if len(self.core.in_flight) == 1:
            self._step_started = time.perf_counter()

    def _finish_step(self, result: StepResult) -> None:
        try:
            step, deltas = self.core.update(result, now=time.time())
        except ValueError as exc:
            logger.error("%s: dropped", exc)
            return
        finished_at = time.perf_counter()
        if step.batch.num_tokens:
            seconds = finished_at - self._step_started
            self.instruments.record_step(self.core.scheduler, step, seconds, result)
        self._step_started = finished_at  # the next step in flight, if any, runs from here
        self._send_deltas(deltas)

    def _send_deltas(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self.outputs.detokenizer.send(EngineOutputs(deltas, time.time()))

    # ---- worker recovery ---------------------------------------------------------

    def _worker_lost(self, reason: str, now: float) -> None:
        if self.recovery.recovering:
            logger.warning("while recovering: %s", reason)
            return
        num_preempted = self.core.drop_worker_state()
        self.recovery.lost(reason, now, num_preempted)
        logger.error(
            "worker lost (%s): %d running request(s) will resume when it is back",
            reason,
            num_preempted,
        )
        self._next_stats = now  # frontends learn it now (/health: recovering)

    def _check_incarnation(self, rank: int, worker: str, now: float) -> None:
        """A heartbeat from another process than the one that answered the hello: the
        worker was restarted (perhaps before its silence was noticed)."""
        known = self.worker_incarnations.get(rank)
        if known and worker and worker != known and not self.recovery.recovering:
            self._worker_lost(f"worker rank {rank} was restarted (a new process)", now)

    def _worker_back(self, info: WorkerInfo, now: float) -> None:
        kv_cache = self.core.scheduler.kv_cache
        if info.num_blocks < kv_cache.num_blocks:  # the pool is sized once, at start-up
            self.dead_reason = (
                f"the restarted worker has {info.num_blocks} KV blocks, "
                f"fewer than the {kv_cache.num_blocks} the scheduler manages"
            )
            return
        took = self.recovery.back(now)
        self.worker_incarnations[info.rank] = info.worker_incarnation
        self.liveness.last_seen = dict.fromkeys(self.liveness.last_seen, now)
        self.liveness.suspect_since = None
        self._stalled = False
        self._next_stats = now
        logger.warning(
            "worker back after %.1f s: %d request(s) resume",
            took,
            self.core.scheduler.num_unfinished_requests,
        )

    def _check_workers(self, now: float) -> None:
        recovery = self.recovery
        if not recovery.recovering:
            lost = self.liveness.dead_reason(now)
            if lost is not None:
                self._worker_lost(lost, now)
        hello_id = recovery.hello_due(now)
        if hello_id is not None:
            self.outputs.plans.send(SchedulerHello(hello_id, leave=recovery.leaving))
        if self.dead_reason is None:
            self.dead_reason = recovery.timed_out(now)

    # ---- periodic work -----------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        self._check_workers(now)
        if now >= self._next_stats:
            self._next_stats = now + STATS_INTERVAL_S
            self.outputs.stats.send(self.stats_message())
            if self.instruments.trace is not None:
                self.instruments.trace.flush()  # a live trace file lags by 0.5 s at most
        idle = not self.core.in_flight and not self.core.has_unfinished_requests()
        kv_cache = self.core.scheduler.kv_cache
        small = kv_cache.num_blocks <= IDLE_INTEGRITY_MAX_BLOCKS
        if idle and small and now >= self._next_integrity:
            self._next_integrity = now + INTEGRITY_INTERVAL_S
            kv_cache.check_integrity()

    def stats_message(self) -> SchedulerStats:
        stats = self.core.scheduler.snapshot()
        counters = self.core.counters
        step_tokens = counters.take_step_tokens()
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
            mm_encoder_cache_queries=counters.mm_encoder_cache_queries,
            mm_encoder_cache_hits=counters.mm_encoder_cache_hits,
            step_tokens=step_tokens,
            # Copies: the meter keeps counting while an in-process receiver holds these.
            roofline={
                k: msgspec.structs.replace(v) for k, v in instruments.roofline.phases.items()
            },
            peak_flops=instruments.peak_flops,
            peak_bandwidth=instruments.peak_bandwidth,
            startup_phases=instruments.startup_phases,
            incarnation=self.incarnation,
            recovering=self.recovery.reason or "",
            num_worker_restarts=self.recovery.num_worker_restarts,
            num_resumed_requests=self.recovery.num_resumed_requests,
            recent_steps=instruments.take_recent_steps(),
            kv_block_map=block_map(self.core.scheduler.kv_cache.block_pool),
            grammar=self.core.grammar_stats(),
            kv_transfer=stats.features.kv_transfer,
            lora=stats.features.lora,
            **spec_decode_stats(stats.features.spec_decode),
            cluster_auth_failures=self.refusals.by_role(),
        )

"""The engine core: admit -> schedule -> (the worker executes) -> update. Sans-IO.

Both the scheduler process (`loop.py`, over ZeroMQ) and the offline `LLM`
(`kvflow/offline/engine.py`, in process) drive this one class, so every rule (admission,
limits, stop conditions, step bookkeeping) lives once. Callers bring the clock: one
wall clock (`time.time()`), the one the frontends' request metrics use.

Steps in flight: up to `max_steps_in_flight` plans may await their results. With 1 the
core plans step N+1 only after step N's result is applied; with 2 (async scheduling)
it plans N+1 while the worker runs N, counting one placeholder token per request that
N samples (request.py). A result that ends a request (EOS, stop, length) retires it
one step late: the token its next, already planned, step samples is never emitted.

    AddRequest ─▶ add_request ─▶ admit ─▶ scheduler.waiting   (InvalidRequestError out;
                   QueueFullError when max_waiting_requests already wait)
    abort_requests ─▶ scheduler.finish_requests ─▶ "abort" deltas
    schedule ─▶ StepPlan (kept in flight) ─▶ the worker
    update(StepResult) ─▶ scheduler.update_from_output ─▶ TokenDeltas
                      └▶ requests past max_queue_delay ─▶ "error" deltas (queue_timeout)

Load limits live here, on the one waiting queue every frontend feeds, so they are exact
however many frontends there are (queue_limits.py).

Guided requests (structured outputs) wait in `waiting_for_grammar` while their grammar
compiles in the pool (grammar_compiler.py); `poll_grammars`, which the transports call
before planning, hands the compiled ones to the scheduler and fails the ones whose
compile failed or ran past the timeout. Nothing here ever waits on a compile.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import InvalidRequestError, RequestRejectedError
from kvflow.metrics.roofline import StepBatch
from kvflow.proto.engine import AddRequest, TokenDelta
from kvflow.proto.stats import GrammarStats
from kvflow.proto.step import StepPlan, StepResult
from kvflow.services.scheduler.admission import EngineLimits, admit
from kvflow.services.scheduler.admission_hold import AdmissionHoldFeature
from kvflow.services.scheduler.grammar_compiler import GrammarCompiler
from kvflow.services.scheduler.grammar_matcher import RequestGrammar
from kvflow.services.scheduler.queue_limits import QueueLimits
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class StepInFlight:
    """A plan whose result is awaited, and the requests whose samples still count
    (a request preempted or aborted since the plan was made drops out)."""

    plan: StepPlan
    batch: StepBatch
    live: set[str]


@dataclass
class TokenCounters:
    """Cumulative token and step counts (for the engine's stats)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    mm_encoder_cache_queries: int = 0  # images looked up in the worker's encoder cache
    mm_encoder_cache_hits: int = 0
    mm_encoder_tokens: int = 0  # image features the vision encoder computed
    step_tokens: list[int] = field(default_factory=list)  # since the last take_step_tokens
    started: set[str] = field(default_factory=set)  # requests with a first token

    def on_step(self, plan: StepPlan, result: StepResult, deltas: list[TokenDelta]) -> None:
        self.mm_encoder_cache_queries += result.encoder_cache_queries
        self.mm_encoder_cache_hits += result.encoder_cache_hits
        self.mm_encoder_tokens += result.encoder_tokens
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

    def take_step_tokens(self) -> list[int]:
        step_tokens, self.step_tokens = self.step_tokens, []
        return step_tokens


@dataclass
class PendingGrammar:
    """A guided request whose grammar is compiling (status WAITING_FOR_GRAMMAR)."""

    request: Request
    future: Future[Any]  # -> xgrammar.CompiledGrammar
    deadline: float  # wall clock; past it the request fails


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        limits: EngineLimits,
        max_steps_in_flight: int = 1,
        grammars: GrammarCompiler | None = None,
        grammar_timeout_s: float = 30.0,
    ) -> None:
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
        self.scheduler = scheduler
        self.limits = limits
        self.max_steps_in_flight = max_steps_in_flight
        self.in_flight: deque[StepInFlight] = deque()
        self.owners: dict[str, str] = {}  # live req_id -> frontend_id
        self.counters = TokenCounters()
        config = scheduler.config
        self.queue_limits = QueueLimits(config.max_waiting_requests, config.max_queue_delay)
        # The code of the last refusal, for error_delta (the loop passes it the text only).
        self._refused: tuple[str, str] | None = None  # (req_id, error code)
        self.grammars = grammars
        self.grammar_timeout_s = grammar_timeout_s
        self.waiting_for_grammar: dict[str, PendingGrammar] = {}

    # ---- requests ----------------------------------------------------------------

    def add_request(self, message: AddRequest, now: float) -> None:
        """Admit a request; raises InvalidRequestError (or PromptTooLongError) with the
        reason when it cannot run. Duplicate ids are refused the same way."""
        if message.req_id in self.owners:
            raise InvalidRequestError(f"duplicate request id {message.req_id!r}")
        try:
            self.queue_limits.check_room(
                len(self.scheduler.waiting) + len(self.waiting_for_grammar)
            )
        except RequestRejectedError as exc:
            self._refused = (message.req_id, exc.code)
            raise
        request = admit(message, self.limits, queued_time=now)
        guided = request.sampling_params.structured_outputs
        if guided is not None and self.grammars is None:
            raise InvalidRequestError(
                "this engine has no grammar compiler", param="structured_outputs"
            )
        if guided is None:
            self.scheduler.add_request(request)  # first: it may refuse (beam search)
            self.owners[message.req_id] = message.frontend_id
            self.queue_limits.on_added(now)
            return
        self.owners[message.req_id] = message.frontend_id
        self.queue_limits.on_added(now)
        assert self.grammars is not None
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        future = self.grammars.submit(guided)
        pending = PendingGrammar(request, future, now + self.grammar_timeout_s)
        self.waiting_for_grammar[message.req_id] = pending

    def poll_grammars(self, now: float) -> list[TokenDelta]:
        """Hand requests whose grammar compiled to the scheduler; returns the final
        deltas of those whose compile failed or timed out."""
        if self.grammars is None or not self.waiting_for_grammar:
            return []
        self.grammars.collect()
        deltas = []
        for req_id, pending in list(self.waiting_for_grammar.items()):
            done = pending.future.done()  # read once: the compile thread may finish meanwhile
            error = self._grammar_error(pending, done, now)
            if error is None and not done:
                continue
            del self.waiting_for_grammar[req_id]
            request = pending.request
            if error is None:
                guided = request.sampling_params.structured_outputs
                reasoning_end = guided.reasoning_end_token_ids if guided is not None else None
                request.grammar = RequestGrammar(pending.future.result(), reasoning_end)
                if not request.grammar.replay(request.output_token_ids):  # a resumed one
                    error = "structured_outputs: the resumed output does not fit its grammar"
            if error is None:
                request.status = RequestStatus.WAITING
                self.scheduler.add_request(request)
                continue
            frontend_id = self.owners.pop(req_id, "")
            delta = self._final_delta(request, "error", frontend_id, error)
            delta.error_param = "structured_outputs"  # the request's grammar: a 400
            deltas.append(delta)
        return deltas

    def grammar_stats(self) -> GrammarStats | None:
        """Compile counts for the stats message (the compile times are taken)."""
        if self.grammars is None or not self.grammars.stats.requests_by_kind:
            return None
        stats = self.grammars.stats
        return GrammarStats(
            compile_seconds=stats.take_compile_seconds(),
            cache_hits=stats.cache_hits,
            cache_misses=stats.cache_misses,
            compile_timeouts=stats.timeouts,
            requests_by_kind=dict(stats.requests_by_kind),
            jump_forward_tokens=self.scheduler.num_jump_forward_tokens,
        )

    def _grammar_error(self, pending: PendingGrammar, done: bool, now: float) -> str | None:
        if done:
            exc = pending.future.exception()
            return None if exc is None else f"structured_outputs: {exc}"
        if now < pending.deadline:
            return None
        assert self.grammars is not None
        self.grammars.stats.timeouts += 1
        return (
            "structured_outputs: the grammar did not compile within "
            f"{self.grammar_timeout_s:g} s (grammar_compile_timeout)"
        )

    def abort_requests(self, req_ids: list[str], finish_reason: str = "abort") -> list[TokenDelta]:
        """Finish requests from outside the step loop: a client that left ("abort") or a
        stop string the detokenizer matched ("stop", already final there, so no delta)."""
        stopped = finish_reason == "stop"
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        finished = [p.request for r in req_ids if (p := self.waiting_for_grammar.pop(r, None))]
        finished += self.scheduler.finish_requests(req_ids, status)
        deltas = []
        for request in finished:
            self._forget(request.request_id)
            owned = request.request_id in self.owners  # not a feature's own (a beam)
            frontend_id = self.owners.pop(request.request_id, "")
            if owned and not stopped:
                deltas.append(self._final_delta(request, "abort", frontend_id))
        return deltas

    def _final_delta(
        self, request: Request, reason: str, frontend_id: str, error: str | None = None
    ) -> TokenDelta:
        return TokenDelta(
            request.request_id,
            [],
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            frontend_id=frontend_id,
            error=error,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.waiting_for_grammar)

    # ---- steps -------------------------------------------------------------------

    @property
    def holds_admission(self) -> bool:
        """The last plan held waiting prompts back (admission_hold.py): plan again soon."""
        hold = self.scheduler.feature(AdmissionHoldFeature)
        return hold is not None and hold.holding

    def can_schedule(self) -> bool:
        return (
            len(self.in_flight) < self.max_steps_in_flight
            and self.scheduler.has_unfinished_requests()
        )

    def schedule(self, now: float) -> StepPlan | None:
        """The next step's plan, now in flight; None when there is nothing to send."""
        plan = self.scheduler.schedule(now=now)
        # While prompt KV arrives in the background, empty steps carry the news of it.
        background = self.scheduler.has_background_work()
        if not (plan.scheduled_req_ids or plan.finished_req_ids or plan.kv_connector or background):
            return None
        for req_id in plan.finished_req_ids:  # preempted or finished: drop stale samples
            self._forget(req_id)
        batch = StepBatch.from_plan(plan, self.scheduler.requests)
        self.in_flight.append(StepInFlight(plan, batch, set(plan.scheduled_req_ids)))
        return plan

    def update(self, result: StepResult, now: float) -> tuple[StepInFlight, list[TokenDelta]]:
        """Apply the oldest step's result; returns that step and the token deltas."""
        if not self.in_flight or self.in_flight[0].plan.step_id != result.step_id:
            raise ValueError(f"result of step {result.step_id} was not awaited")
        step = self.in_flight.popleft()
        self.scheduler.on_step_returned(step.plan)
        if len(step.live) < len(result.req_ids):
            result = _only_live(result, step.live)
        deltas = self.scheduler.update_from_output(step.plan, result, now=now)
        self.counters.on_step(step.plan, result, deltas)
        for delta in deltas:
            if delta.finish_reason is None:
                delta.frontend_id = self.owners.get(delta.req_id, "")
            else:
                delta.frontend_id = self.owners.pop(delta.req_id, "")
        return step, deltas + self.expire_waiting(now)

    def expire_waiting(self, now: float) -> list[TokenDelta]:
        """Fail the requests that waited longer than max_queue_delay for their first
        step (update() calls this: while requests wait, steps run)."""
        expired = self.queue_limits.expired(self.scheduler.waiting, now)
        if not expired:
            return []
        error = self.queue_limits.timeout_error()
        deltas = []
        for request in self.scheduler.finish_requests(expired, RequestStatus.FINISHED_ERROR):
            self._forget(request.request_id)
            deltas.append(
                TokenDelta(
                    request.request_id,
                    [],
                    finish_reason="error",
                    num_prompt_tokens=request.num_prompt_tokens,
                    frontend_id=self.owners.pop(request.request_id, ""),
                    error=str(error),
                    error_code=error.code,
                )
            )
        return deltas

    def drop_worker_state(self) -> int:
        """The worker died: its steps in flight never return and its KV is gone. Every
        running request recomputes from its prompt and the tokens already emitted, so
        its stream goes on where it stopped. Returns how many requests were running."""
        self.in_flight.clear()
        return self.scheduler.preempt_all()

    def error_delta(self, message: AddRequest, error: str) -> TokenDelta:
        """The final delta of a request that could not be admitted."""
        refused, self._refused = self._refused, None
        return TokenDelta(
            message.req_id,
            [],
            finish_reason="error",
            num_prompt_tokens=len(message.prompt_token_ids),
            frontend_id=message.frontend_id,
            error=error,
            error_code=refused[1] if refused and refused[0] == message.req_id else None,
        )

    def _forget(self, req_id: str) -> None:
        self.counters.started.discard(req_id)
        for step in self.in_flight:
            step.live.discard(req_id)


def _only_live(result: StepResult, live: set[str]) -> StepResult:
    """The result without the samples of requests that left since its plan was made."""
    keep = [i for i, req_id in enumerate(result.req_ids) if req_id in live]
    return StepResult(
        step_id=result.step_id,
        req_ids=[result.req_ids[i] for i in keep],
        sampled_token_ids=[result.sampled_token_ids[i] for i in keep],
        logprobs=[result.logprobs[i] for i in keep] if result.logprobs else [],
        prompt_logprobs={k: v for k, v in result.prompt_logprobs.items() if k in live},
        prompt_logprobs_start={k: v for k, v in result.prompt_logprobs_start.items() if k in live},
        execute_time_s=result.execute_time_s,
        kv_transfer=result.kv_transfer,
        stage_spans=result.stage_spans,
        pooled=[result.pooled[i] for i in keep] if result.pooled else [],
        encoder_cache_queries=result.encoder_cache_queries,
        encoder_cache_hits=result.encoder_cache_hits,
        encoder_tokens=result.encoder_tokens,
    )

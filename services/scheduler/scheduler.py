"""The continuous-batching scheduler: a sans-IO core (messages in, messages out).

One token budget per step and no prefill/decode modes: running requests first (each
takes what it still needs: 1 token for a decode, the rest of a prompt, capped by
`long_prefill_token_threshold`), then waiting requests in the prefill policy's order
(prefill_order.py), their prompts chunked to fit the budget. When the KV pool is full,
the lowest-priority running request (the newest under FCFS) is preempted by recompute.
The scheduler never touches block internals; `KVCacheManager` does. Everything a request
option or a deployment adds (speculative decoding, KV transfer, pipeline micro-batches,
jump-forward, prompt logprobs, pooling, beam search) is a step feature (step_features.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

from kvflow.config import SchedulerConfig
from kvflow.proto.engine import TokenDelta
from kvflow.proto.step import (
    CachedRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from kvflow.services.scheduler.grammar_matcher import build_bitmask
from kvflow.services.scheduler.jump_forward import JumpForwardFeature
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.prefill_order import PrefillOrder
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.request_queue import make_request_queue
from kvflow.services.scheduler.request_times import RequestTimes, error_delta
from kvflow.services.scheduler.snapshot import SchedulerSnapshot, take_snapshot
from kvflow.services.scheduler.spec_decode.speculator import Speculator
from kvflow.services.scheduler.spec_decode.step_feature import SpecDecodeFeature
from kvflow.services.scheduler.step_features import StepBuilder, StepFeature
from kvflow.services.scheduler.waiting_blocks import allocate_waiting

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=StepFeature)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        vocab_size: int = 0,  # the logits' width: guided decoding's bitmask rows
        features: Sequence[StepFeature] = (),  # features.make_step_features
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.features = list(features)
        self.waiting = make_request_queue(config.policy)
        self.prefill = PrefillOrder(config.prefill_order)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step_id = 0
        self._worker_forget: list[str] = []  # finished/preempted since the last plan
        self.times = RequestTimes()

    def feature(self, kind: type[F]) -> F | None:
        """The registered feature of that class (None: not on)."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    @property
    def speculator(self) -> Speculator | None:
        return spec.speculator if (spec := self.feature(SpecDecodeFeature)) else None

    @property
    def num_jump_forward_tokens(self) -> int:
        return jump.num_tokens if (jump := self.feature(JumpForwardFeature)) else 0

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (a feature may keep it and queue others: beam search)."""
        assert request.request_id not in self.requests, request.request_id
        kept = [f.on_add(request) for f in self.features]  # every feature hears of it
        queued = next((q for q in kept if q is not None), None)
        self.requests[request.request_id] = request
        for queue in [request] if queued is None else queued:
            self.requests[queue.request_id] = queue
            self.waiting.push(queue)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort (or stop, for stop strings) requests from outside the step loop."""
        finished: list[Request] = []
        # A missing id already finished (aborts race completion); companions go too.
        pending = [r for req_id in req_ids if (r := self.requests.get(req_id)) is not None]
        while pending:
            request = pending.pop(0)
            if request.is_finished:
                continue
            pending += [c for f in self.features for c in f.companions(request)]
            parked = request.status.is_parked  # its blocks are its feature's
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not parked:
                self.waiting.remove(request)
            request.status = status
            self._release(request, keep_blocks=parked)
            finished.append(request)
        return finished

    def has_background_work(self) -> bool:
        """A feature needs steps even without requests (e.g. to hear a KV load end)."""
        return any(f.has_background_work() for f in self.features)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.has_background_work()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ----------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> StepPlan:
        step = StepBuilder(self.config.max_num_batched_tokens, self.running)
        for f in self.features:
            f.begin_step(step)
        self._schedule_running(step)
        if not step.preempted:  # admitting new work while preempting would thrash
            self._schedule_waiting(step, now)
        sampling = []
        for req_id, num_tokens in step.scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == request.num_planned_tokens:
                request.num_output_placeholders += 1  # this step samples for it
                sampling.append(request)
            for f in self.features:
                f.on_scheduled(request, num_tokens, step)
        for f in self.features:
            f.end_step(step)
        for request in step.to_preempt:  # a feature's call (beams that would stall)
            self._preempt(request, step)
        self._step_id += 1
        plan = StepPlan(
            step_id=self._step_id,
            new_requests=step.new_requests,
            cached_requests=step.cached_requests,
            scheduled_req_ids=list(step.scheduled),
            num_scheduled_tokens=list(step.scheduled.values()),
            finished_req_ids=self._worker_forget,
            grammar_bitmask=build_bitmask(sampling, self.vocab_size),
            spec_token_ids=step.spec_tokens,
            kv_connector=step.kv_connector,
            forced_token_ids=step.forced_token_ids,
            kv_block_copies=step.kv_block_copies,
        )
        self._worker_forget = []
        return plan

    def on_step_returned(self, plan: StepPlan) -> None:
        """The result of `plan` is back (before it is applied)."""
        for f in self.features:
            f.on_step_returned(plan)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_planned_tokens - request.num_computed_tokens
        # Decoding on a token still in flight: only if that sample may be followed.
        placeholder = num_new == 1 and request.num_output_placeholders > 0
        if placeholder and not request.may_sample_more(self.max_model_len):
            return 0
        if placeholder and request.grammar is not None:
            return 0  # its mask needs the grammar state after the token in flight
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        num_new = min(num_new, budget)
        for f in self.features:  # e.g. the encoder budget ends a chunk before an image
            num_new = f.cap_tokens(request, num_new)
        return num_new

    def _schedule_running(self, step: StepBuilder) -> None:
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            index += 1
            if any(f.holds_back(request) for f in self.features):
                continue
            num_new = self._num_new_tokens(request, step.budget)
            if num_new == 0:
                continue
            plans = (f.plan_running(request, num_new, step) for f in self.features)
            planned = next((p for p in plans if p is not None), None)
            if planned is None:
                new_block_ids = self._allocate_or_preempt(request, num_new, step)
                if new_block_ids is None:
                    break  # the request itself was preempted: nothing further fits
            elif planned.num_tokens == 0:
                continue  # a feature holds it back this step
            else:
                num_new, new_block_ids = planned.num_tokens, planned.block_ids
            cached = CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens,
                new_group_block_ids=self.kv_cache.take_new_group_block_ids(request.request_id),
            )  # fmt: skip
            for f in self.features:
                f.on_scheduled_running(request, cached, step)
            step.cached_requests.append(cached)
            step.add(request, num_new)
            index = self.running.index(request) + 1  # victims may have been removed

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: StepBuilder
    ) -> list[int] | None:
        while True:
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            self._preempt(self._pick_victim(), step)
            if request.status != RequestStatus.RUNNING:  # the victim, or its companion
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: r.sort_key())
        return self.running[-1]

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        self.running.remove(request)
        planned = request.request_id in step.scheduled
        if planned:  # already planned this step: take it back
            step.budget += step.scheduled.pop(request.request_id)
            step.cached_requests = [
                c for c in step.cached_requests if c.req_id != request.request_id
            ]
        # A planned victim's KV of this step is never written: its hashes must go too.
        self.kv_cache.free(request.request_id, step_discarded=planned)
        self._back_to_waiting(request, step)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._worker_forget.append(request.request_id)
        step.preempted.append(request)
        logger.warning(
            "preempted request %s by recompute (KV cache full; %d preemptions so far)",
            request.request_id, self.num_preemptions,
        )  # fmt: skip
        for other in [c for f in self.features for c in f.companions(request)]:
            if other in self.running:  # e.g. the other beams of a beam search
                self._preempt(other, step)

    def _back_to_waiting(self, request: Request, step: StepBuilder | None) -> None:
        """Preemption by recompute, on both paths (KV cache full; worker lost)."""
        for f in self.features:
            f.on_preempt(request, step)
        request.reset_for_recompute()
        self.waiting.push_front(request)

    def _schedule_waiting(self, step: StepBuilder, now: float) -> None:
        if len(self.waiting) == 0:
            return
        admitted: list[Request] = []
        passed_over: set[str] = set()
        for request in self.prefill.admission_order(self.waiting, passed_over):
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if any(f.stops_admission(request) for f in self.features):
                break
            if any(f.skips_admission(request) for f in self.features):
                passed_over.add(request.request_id)
                continue
            allocated = allocate_waiting(
                request, step.budget, self.kv_cache, self.features, self._num_new_tokens
            )
            if allocated is None:
                break  # nobody behind it jumps the queue for lack of KV blocks
            num_new, parked = allocated
            self._take_waiting(request)
            admitted.append(request)
            self.times.on_admitted(request.request_id, now)
            if parked:  # its KV arrives in the background: no step until it has
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            tables = self.kv_cache.get_block_ids(request.request_id)
            groups = self.kv_cache.get_group_block_ids(request.request_id)
            step.new_requests.append(request.new_request_data(tables, groups))
            step.add(request, num_new)
        self.prefill.on_admitted(admitted)

    def _take_waiting(self, request: Request) -> None:
        # `remove` when admitted ahead of its queue position (prefill order `shortest`)
        self.waiting.pop() if self.waiting.peek() is request else self.waiting.remove(request)

    # ---- results -----------------------------------------------------------------

    def update_from_output(
        self, plan: StepPlan, result: StepResult, now: float = 0.0
    ) -> list[TokenDelta]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        events = [e for f in self.features if (e := f.on_result(result)) is not None]
        taken = set().union(*(e.taken for e in events))
        applied = [entry for e in events for entry in e.finished]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in applied]
        for index, req_id in enumerate(result.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or req_id in taken:
                continue  # aborted while the step ran, or a feature applied it
            sampled = result.sampled_token_ids[index]
            for f in self.features:
                f.on_sampled(request, len(sampled))
            new_token_ids = request.append_sampled(sampled, self.max_model_len)
            applied.append((request, new_token_ids))
            logprobs.append(result.logprobs[index][: len(new_token_ids)] if result.logprobs else [])
        for f in self.features:
            f.on_tokens(applied)
        deltas = []
        for (request, new_token_ids), token_logprobs in zip(applied, logprobs):
            delta, first = self.times.delta(request, new_token_ids, token_logprobs, now)
            for f in self.features:
                f.on_delta(delta, first)
            deltas.append(delta)
            if request.is_finished:
                if request in self.running:  # (not a feature's parked request)
                    self.running.remove(request)
                self._release(request)
        for event in events:  # a feature's decisions from the step's side outputs
            for request in event.dropped:
                self.running.remove(request)
                self._release(request)
            for request in reversed(event.requeue):
                self.requests[request.request_id] = request
                self.waiting.push_front(request)
            for request in event.failed:
                self._release(request)
                deltas.append(error_delta(request, event.error))
        return deltas

    def _release(self, request: Request, keep_blocks: bool = False) -> None:
        """Free a finished request's blocks and tell the worker to forget it."""
        if not keep_blocks:
            self.kv_cache.free(request.request_id)
        for f in self.features:
            f.on_finish(request)
        self.requests.pop(request.request_id, None)
        self.times.forget(request.request_id)
        self.prefill.forget(request.request_id)
        self._worker_forget.append(request.request_id)

    def preempt_all(self) -> int:
        """The worker died with every KV block: each running request goes back to the
        queue's front (in order) to recompute, every cached prefix is forgotten (its KV is
        gone). Returns how many requests were running."""
        running, self.running = self.running, []
        for request in reversed(running):  # push_front: the oldest ends up first
            self.kv_cache.free(request.request_id, step_discarded=True)
            self._back_to_waiting(request, None)
        self._worker_forget = []  # the new worker knows no request
        for f in self.features:
            for request in reversed(f.on_worker_lost()):
                self.waiting.push_front(request)
        reset = self.kv_cache.reset_prefix_cache()
        assert reset, "a block is still held after every request was preempted"
        return len(running)

    def snapshot(self) -> SchedulerSnapshot:
        """The counts for one stats message (the KV transfer times are taken)."""
        return take_snapshot(self)

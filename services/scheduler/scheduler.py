"""The continuous-batching scheduler: a sans-IO core (messages in, messages out).

One token budget per step and no prefill/decode modes: running requests first (each
takes what it still needs to compute: 1 token for a decode, the rest of a prompt for
a prefill, capped by `long_prefill_token_threshold`), then waiting requests in the
prefill policy's order (prefill_order.py: queue order, or shortest prompt first), whose
prompts are split into chunks when they do not fit the budget. When the KV pool is full, the lowest-priority running request (the newest under FCFS) is
preempted by recompute: its blocks are freed and it goes back to the waiting queue.
The scheduler never touches block internals; `KVCacheManager` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvflow.config import SchedulerConfig
from kvflow.kv_transfer.scheduler.connector import KVConnectorScheduler, PromptDone
from kvflow.kv_transfer.scheduler.remote_loads import RemoteKVLoads
from kvflow.proto.engine import TokenDelta
from kvflow.proto.kv_transfer import KVConnectorMeta, KVTransferStats
from kvflow.proto.step import (
    CachedRequestData,
    NewRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from kvflow.services.scheduler.grammar_matcher import build_bitmask, fill_rows
from kvflow.services.scheduler.jump_forward import jump_forward
from kvflow.services.scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvflow.services.scheduler.micro_batches import MicroBatches, is_decode, unsent_token_ids
from kvflow.services.scheduler.prefill_order import PrefillOrder
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.request_queue import make_request_queue
from kvflow.services.scheduler.spec_decode.speculator import SpecDecodeCounters, Speculator

logger = logging.getLogger(__name__)


@dataclass
class SchedulerSnapshot:
    """The core's own counts at one moment (the loop adds its counters and sends
    `proto.stats.SchedulerStats`)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode: SpecDecodeCounters | None = None  # None: no speculative decoding


@dataclass
class _StepBuilder:
    """Accumulates one step's plan while the budget is spent."""

    budget: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    scheduled: dict[str, int]  # req_id -> tokens, insertion order = batch order
    preempted: list[Request]
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> drafts

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        vocab_size: int = 0,  # the logits' width: guided decoding's bitmask rows
        speculator: Speculator | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        pipeline_depth: int = 1,  # pipeline stages: micro_batches.py's rules when > 1
    ) -> None:
        self.config = config
        self.micro_batches = MicroBatches(pipeline_depth) if pipeline_depth > 1 else None
        self.speculator = speculator
        self.kv_connector = kv_connector  # disaggregated prefill/decode (services/kv_transfer)
        self.remote_loads: RemoteKVLoads | None = None  # connectors that load asynchronously
        if kv_connector is not None and kv_connector.load_is_async:
            self.remote_loads = RemoteKVLoads(kv_cache, kv_connector.failure_policy)
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.waiting = make_request_queue(config.policy)
        self.prefill = PrefillOrder(config.prefill_order)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step_id = 0
        self._worker_forget: list[str] = []  # finished/preempted since the last plan
        self._worker_forced: dict[str, list[int]] = {}  # jump-forward since the last plan
        self.num_jump_forward_tokens = 0
        self._scheduled_time: dict[str, float] = {}
        self._first_token_time: dict[str, float] = {}
        # Prompt logprobs arrive chunk by chunk; sent whole with the first token.
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort (or stop, for stop strings) requests from outside the step loop."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue  # already finished: aborts race with completion
            parked = request.status == RequestStatus.WAITING_FOR_REMOTE_KV
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif parked:
                assert self.remote_loads is not None
                self.remote_loads.abandon(request)  # its blocks: when the pull ends
            elif not request.is_finished:
                self.waiting.remove(request)
            request.status = status
            self._release(request, keep_blocks=parked)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        # An aborted request still loading counts: steps must go on to hear the pull end.
        loading = self.remote_loads is not None and bool(self.remote_loads.loading)
        return bool(self.requests) or loading

    def kv_transfer_stats(self) -> KVTransferStats | None:
        """The connector's counts for the stats message (None without a connector)."""
        if self.kv_connector is None:
            return None
        stats = self.kv_connector.take_stats()
        if self.remote_loads is not None:
            stats.num_waiting_for_remote_kv = len(self.remote_loads)
        return stats

    def on_kv_loads(self, finished: list[str], failed: list[str]) -> list[Request]:
        """Asynchronous loads that ended: ready requests go first in the queue, failed
        ones recompute or fail (returned: they need a final delta)."""
        if self.remote_loads is None or not (finished or failed):
            return []
        outcomes = self.remote_loads.on_outcomes(finished, failed)
        if self.kv_connector is not None:
            self.kv_connector.counters.num_load_failures = self.remote_loads.num_failures
        for request in reversed(outcomes.ready + outcomes.recompute):
            self.waiting.push_front(request)
        for request in outcomes.failed:
            self._release(request)
        return outcomes.failed

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ----------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> StepPlan:
        step = _StepBuilder(self.config.max_num_batched_tokens, [], [], {}, [])
        self._schedule_running(step)
        if not step.preempted:  # admitting new work while preempting would thrash
            self._schedule_waiting(step, now)
        sampling = []
        prompts_done: list[Request] = []
        for req_id, num_tokens in step.scheduled.items():
            request = self.requests[req_id]
            if self.kv_connector is not None:
                self._count_prompt_work(request, num_tokens, prompts_done)
            request.num_computed_tokens += num_tokens
            drafts = step.spec_tokens.get(req_id)
            if drafts is not None:  # verifies its drafts, then samples one more token
                request.num_spec_in_flight = len(drafts)
                request.num_output_placeholders += 1
            elif request.num_computed_tokens == request.num_planned_tokens:
                request.num_output_placeholders += 1  # this step samples for it
                sampling.append(request)
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
            kv_connector=self._connector_meta(prompts_done),
            forced_token_ids=self._worker_forced,
        )
        self._worker_forget = []
        self._worker_forced = {}
        if self.micro_batches is not None:
            self.micro_batches.on_planned(plan.scheduled_req_ids)
        return plan

    def on_step_returned(self, plan: StepPlan) -> None:
        """The result of `plan` is back (pipeline parallelism: its requests may run again)."""
        if self.micro_batches is not None:
            self.micro_batches.on_returned(plan.scheduled_req_ids)

    def _count_prompt_work(
        self, request: Request, num_tokens: int, prompts_done: list[Request]
    ) -> None:
        """Before a scheduled chunk is counted as computed: the prompt tokens it computes
        (a decode instance's metric) and whether it completes the prompt (a save)."""
        assert self.kv_connector is not None
        num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
        if num_prompt_left > 0:
            counters = self.kv_connector.counters
            counters.num_computed_prompt_tokens += min(num_prompt_left, num_tokens)
            if num_prompt_left <= num_tokens:
                prompts_done.append(request)

    def _connector_meta(self, prompts_done: list[Request]) -> KVConnectorMeta | None:
        if self.kv_connector is None:
            return None
        get_block_ids = self.kv_cache.get_block_ids
        done = [PromptDone(r, get_block_ids(r.request_id)) for r in prompts_done]
        return self.kv_connector.build_meta(done)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_spec_in_flight is not None:
            return 0  # its accepted tokens, hence its next position, are not known yet
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
        return min(num_new, budget)

    def _schedule_running(self, step: _StepBuilder) -> None:
        micro = self.micro_batches
        decodes_left = micro.decode_cap(len(self.running)) if micro is not None else -1
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            if micro is not None and (
                micro.busy(request) or (decodes_left == 0 and is_decode(request))
            ):
                index += 1
                continue
            num_new = self._num_new_tokens(request, step.budget)
            if num_new == 0:
                index += 1
                continue
            speculates = num_new == 1 and self._speculates(request)
            if speculates and request.num_output_placeholders > 0:
                index += 1  # drafts need every token known: wait for the one in flight
                continue
            new_block_ids = self._allocate_drafts(request, step) if speculates else None
            if new_block_ids is None:
                new_block_ids = self._allocate_or_preempt(request, num_new, step)
            else:
                num_new += len(step.spec_tokens[request.request_id])
            if new_block_ids is None:
                break  # the request itself was preempted: nothing further fits
            cached = CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens
            )
            if micro is not None:
                decodes_left -= is_decode(request)
                forced = self._worker_forced.get(request.request_id, [])
                cached.new_token_ids = unsent_token_ids(request, len(forced))
            step.cached_requests.append(cached)
            step.add(request, num_new)
            index = self.running.index(request) + 1  # victims may have been removed

    def _speculates(self, request: Request) -> bool:
        """Whether this decode of `request` should come with drafts (once per decode
        scheduled: the speculator's off-switches count these). Guided requests decode
        without drafts: verifying them would need a grammar mask per draft position."""
        params = request.sampling_params
        if self.speculator is None or not params.speculative or params.structured_outputs:
            return False
        return self.speculator.wants(request.request_id, len(self.running))

    def _allocate_drafts(self, request: Request, step: _StepBuilder) -> list[int] | None:
        """For a decode whose tokens are all known: propose drafts and make room for
        1 + k tokens. None (nothing changed) when it does not speculate this step or
        the room is not there (then it decodes plainly rather than preempting others).
        The drafts never reach past max_tokens or the context, even if all are accepted
        and a bonus token follows."""
        assert self.speculator is not None
        max_drafts = min(
            step.budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        drafts = self.speculator.propose(
            request.request_id,
            request.all_token_ids,
            request.num_prompt_tokens,
            max_drafts,
        )
        if not drafts:
            return None
        new_block_ids = self.kv_cache.allocate_slots(request, 1 + len(drafts))
        if new_block_ids is not None:
            step.spec_tokens[request.request_id] = drafts
        return new_block_ids

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: _StepBuilder
    ) -> list[int] | None:
        while True:
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: r.sort_key())
        return self.running[-1]

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        self.running.remove(request)
        planned = request.request_id in step.scheduled
        if planned:  # already planned this step: take it back
            step.budget += step.scheduled.pop(request.request_id)
            step.spec_tokens.pop(request.request_id, None)
            step.cached_requests = [
                c for c in step.cached_requests if c.req_id != request.request_id
            ]
        # A planned victim's KV of this step is never written: its hashes must go too.
        self.kv_cache.free(request.request_id, step_discarded=planned)
        self._worker_forced.pop(request.request_id, None)  # it resumes with all its tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # the in-flight samples are dropped
        request.num_spec_in_flight = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._worker_forget.append(request.request_id)
        self.waiting.push_front(request)
        step.preempted.append(request)
        logger.warning(
            "preempted request %s by recompute (KV cache full; %d preemptions so far)",
            request.request_id,
            self.num_preemptions,
        )

    def _schedule_waiting(self, step: _StepBuilder, now: float) -> None:
        if len(self.waiting) == 0:
            return
        admitted: list[Request] = []
        for request in self.prefill.admission_order(self.waiting):
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.micro_batches is not None and self.micro_batches.busy(request):
                break  # preempted with a step in flight: it resumes once that is back
            allocated = self._allocate_waiting(request, step.budget)
            if allocated is None:
                break  # nobody behind it jumps the queue for lack of KV blocks
            num_new, parked = allocated
            self._take_waiting(request)
            admitted.append(request)
            self._scheduled_time.setdefault(request.request_id, now)
            if parked:  # its KV arrives in the background: no step until it has
                assert self.remote_loads is not None
                self.remote_loads.park(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.new_requests.append(self._new_request_data(request))
            step.add(request, num_new)
        self.prefill.on_admitted(admitted)

    def _take_waiting(self, request: Request) -> None:
        if self.waiting.peek() is request:
            self.waiting.pop()
        else:  # admitted ahead of its queue position (prefill order `shortest`)
            self.waiting.remove(request)

    def _allocate_waiting(self, request: Request, budget: int) -> tuple[int, bool] | None:
        """Blocks for a waiting request's next chunk (after its prefix-cache hit and
        what a KV connector loads): (tokens to compute, parked for an asynchronous
        load), or None (nothing changed) when it cannot start now."""
        remote = self.remote_loads
        if remote is not None and remote.take_loaded(request):  # holds its loaded blocks
            num_new = self._num_new_tokens(request, budget)
            if self.kv_cache.allocate_slots(request, num_new) is None:
                remote.put_back_loaded(request)
                return None
            return num_new, False
        computed = ComputedBlocks([], 0)
        if request.sampling_params.prompt_logprobs is None:  # those need every position
            computed = self.kv_cache.get_computed_blocks(request)
        if remote is not None and remote.blocks_pending(computed.block_ids):
            return None  # its prefix is still arriving for another request
        num_local = computed.num_computed_tokens
        num_external = self._num_external_tokens(request, num_local)
        parked = num_external > 0 and remote is not None
        request.num_computed_tokens = num_local + num_external
        num_new = 0 if parked else self._num_new_tokens(request, budget)
        # allocate_slots counts a new request's KV from its local hit alone.
        request.num_computed_tokens = num_local
        if self.kv_cache.allocate_slots(request, num_external + num_new, computed) is None:
            request.num_computed_tokens = 0
            return None
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_local
        if num_external:
            request.num_computed_tokens += num_external
            self._on_external_alloc(request, num_local, num_external)
        return num_new, parked

    def _num_external_tokens(self, request: Request, num_local: int) -> int:
        """Prompt tokens past the local hit whose KV a connector loads from outside."""
        if self.kv_connector is None:
            return 0
        if self.remote_loads is not None and not self.remote_loads.may_load(request):
            return 0  # its load failed once: computed here (kv_load_failure_policy)
        return self.kv_connector.get_num_new_matched_tokens(request, num_local)

    def _on_external_alloc(self, request: Request, num_local: int, num_external: int) -> None:
        assert self.kv_connector is not None
        block_ids = self.kv_cache.get_block_ids(request.request_id)
        self.kv_connector.update_state_after_alloc(request, block_ids, num_local, num_external)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=list(self.kv_cache.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
        )

    # ---- results -----------------------------------------------------------------

    def update_from_output(
        self, plan: StepPlan, result: StepResult, now: float = 0.0
    ) -> list[TokenDelta]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        for req_id, chunk in result.prompt_logprobs.items():
            self._collect_prompt_logprobs(req_id, result.prompt_logprobs_start[req_id], chunk)
        applied: list[tuple[Request, list[int], list[TokenLogprobs]]] = []
        for index, req_id in enumerate(result.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if request.num_spec_in_flight is not None:
                self._roll_back_rejected(request, len(result.sampled_token_ids[index]))
            new_token_ids = []
            for token_id in result.sampled_token_ids[index]:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if not _grammar_accepts(request, token_id):
                    break
                if request.check_stop(self.max_model_len):
                    break
            logprobs = result.logprobs[index][: len(new_token_ids)] if result.logprobs else []
            applied.append((request, new_token_ids, logprobs))
        jump = self.config.grammar_jump_forward
        if jump:  # its probes read the next masks: fill them all in one batched call
            fill_rows([r.grammar for r, _, _ in applied if r.grammar and not r.is_finished])
        deltas = []
        for request, new_token_ids, logprobs in applied:
            if jump and request.grammar is not None:
                new_token_ids += self._jump_forward(request)
            deltas.append(self._make_delta(request, new_token_ids, logprobs, result, now))
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
        return deltas

    def _jump_forward(self, request: Request) -> list[int]:
        forced = jump_forward(request, self.max_model_len)
        if forced and not request.is_finished:  # a finished request's KV is not needed
            self._worker_forced.setdefault(request.request_id, []).extend(forced)
        self.num_jump_forward_tokens += len(forced)
        return forced

    def _roll_back_rejected(self, request: Request, num_emitted: int) -> None:
        """A verification step computed KV for the last token and k drafts; the accepted
        ones (num_emitted - 1) stay, the rejected positions count as not computed, and
        the next step writes over them. Their blocks stay with the request for that
        (freed with it), and were never hashed: hashes cover known tokens only."""
        num_drafts = request.num_spec_in_flight
        assert num_drafts is not None
        num_accepted = num_emitted - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        request.num_spec_in_flight = None
        assert self.speculator is not None
        self.speculator.on_verified(request.request_id, num_drafts, num_accepted)

    def _collect_prompt_logprobs(self, req_id: str, start: int, chunk: list[TokenLogprobs]) -> None:
        # Indexed by position so a chunk recomputed after preemption overwrites itself.
        collected = self._prompt_logprobs.setdefault(req_id, [])
        del collected[start:]
        collected.extend(chunk)

    def _make_delta(
        self,
        request: Request,
        new_token_ids: list[int],
        logprobs: list[TokenLogprobs],
        result: StepResult,
        now: float,
    ) -> TokenDelta:
        first = request.request_id not in self._first_token_time
        if first:
            self._first_token_time[request.request_id] = now
        return TokenDelta(
            req_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queued_time=request.arrival_time,
            scheduled_time=self._scheduled_time.get(request.request_id, now),
            first_token_time=self._first_token_time[request.request_id],
            prompt_logprobs=self._prompt_logprobs.pop(request.request_id, []) if first else [],
        )

    def _release(self, request: Request, keep_blocks: bool = False) -> None:
        """Free a finished request's blocks and tell the worker to forget it."""
        if self.speculator is not None:
            self.speculator.finish(
                request.request_id, request.all_token_ids, request.num_prompt_tokens
            )
        if not keep_blocks:
            self.kv_cache.free(request.request_id)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        if self.remote_loads is not None:
            self.remote_loads.forget(request)
        self.requests.pop(request.request_id, None)
        self._scheduled_time.pop(request.request_id, None)
        self._first_token_time.pop(request.request_id, None)
        self._prompt_logprobs.pop(request.request_id, None)
        self._worker_forced.pop(request.request_id, None)
        self.prefill.forget(request.request_id)
        self._worker_forget.append(request.request_id)

    def preempt_all(self) -> int:
        """The worker died with every KV block: put each running request back at the
        front of the queue (in order) to recompute prompt and outputs, and forget every
        cached prefix (its KV is gone). Returns how many requests were running."""
        running, self.running = self.running, []
        for request in reversed(running):  # push_front: the oldest ends up first
            self.kv_cache.free(request.request_id, step_discarded=True)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0  # the in-flight samples are lost
            self.waiting.push_front(request)
        self._worker_forget = []  # the new worker knows no request
        if self.remote_loads is not None:
            for request in reversed(self.remote_loads.drop_all()):
                self.waiting.push_front(request)
        self._worker_forced = {}  # nor their tokens: each resumes with all of them
        if self.micro_batches is not None:
            self.micro_batches.clear()  # their steps never return
        reset = self.kv_cache.reset_prefix_cache()
        assert reset, "a block is still held after every request was preempted"
        return len(running)

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode=None if self.speculator is None else self.speculator.counters,
        )


def _grammar_accepts(request: Request, token_id: int) -> bool:
    """Advance a guided request's matcher; a token outside its grammar (the mask makes
    that impossible unless something else forced every token out) fails the request."""
    if request.grammar is None or request.grammar.accept(token_id):
        return True
    logger.error("request %s sampled token %d outside its grammar", request.request_id, token_id)
    request.status = RequestStatus.FINISHED_ERROR
    return False

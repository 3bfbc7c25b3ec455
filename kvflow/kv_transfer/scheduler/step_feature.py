"""KV transfer as a scheduler step feature: the connector's scheduler side plus, for
connectors that load in the background, the parked requests (remote_loads.py).

    admission:   local prefix hit ─▶ get_num_new_matched_tokens (External)
    on_allocated:                  └▶ update_state_after_alloc (and park, if async)
    on_scheduled: a chunk that completes a prompt ─▶ end_step: build_meta (the plan's
                                                     kv_connector: loads and saves)
    on_result:   worker byte counts; loads that ended ─▶ requeued or failed
    on_finish:   request_finished (a parked request's blocks wait for its pull's end)

It depends on the scheduler's public types only; the scheduler never names it.
"""

from __future__ import annotations

from kvflow.kv_transfer.scheduler.connector import KVConnectorScheduler, PromptDone
from kvflow.kv_transfer.scheduler.remote_loads import RemoteKVLoads
from kvflow.proto.step import StepResult
from kvflow.services.scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.snapshot import FeatureStats
from kvflow.services.scheduler.step_features import (
    NOTHING_EXTERNAL,
    External,
    ResultEvents,
    StepBuilder,
    StepFeature,
)

LOAD_FAILED = "the prompt's KV could not be loaded from its producer (kv_load_failure_policy=fail)"


class KVTransferFeature(StepFeature):
    def __init__(self, connector: KVConnectorScheduler, kv_cache: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache = kv_cache
        self.remote_loads: RemoteKVLoads | None = None  # connectors that load asynchronously
        if connector.load_is_async:
            self.remote_loads = RemoteKVLoads(kv_cache, connector.failure_policy)
        self._prompts_done: list[Request] = []  # this step's chunks that end a prompt

    # ---- admission -----------------------------------------------------------------

    def admission(self, request: Request, computed: ComputedBlocks) -> External | None:
        remote = self.remote_loads
        if remote is not None and remote.blocks_pending(computed.block_ids):
            return None  # its prefix is still arriving for another request
        if remote is not None and not remote.may_load(request):
            return NOTHING_EXTERNAL  # its load failed once: computed here
        num_local = computed.num_computed_tokens
        num_external = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external == 0:
            return NOTHING_EXTERNAL
        return External(num_external, parked=remote is not None)

    def on_allocated(self, request: Request, num_local: int, external: External) -> None:
        block_ids = self.kv_cache.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_local, external.num_tokens)
        if external.parked:
            assert self.remote_loads is not None
            self.remote_loads.park(request)

    # ---- the plan ------------------------------------------------------------------

    def on_scheduled(self, request: Request, num_tokens: int, step: StepBuilder) -> None:
        """The prompt tokens a chunk computes (a decode instance's metric) and whether
        it completes the prompt (a save)."""
        if self.remote_loads is not None:
            self.remote_loads.started(request)
        num_computed_before = request.num_computed_tokens - num_tokens
        num_prompt_left = request.num_prompt_tokens - num_computed_before
        if num_prompt_left > 0:
            counters = self.connector.counters
            counters.num_computed_prompt_tokens += min(num_prompt_left, num_tokens)
            if num_prompt_left <= num_tokens:
                self._prompts_done.append(request)

    def end_step(self, step: StepBuilder) -> None:
        get_block_ids = self.kv_cache.get_block_ids
        done = [PromptDone(r, get_block_ids(r.request_id)) for r in self._prompts_done]
        self._prompts_done = []
        step.kv_connector = self.connector.build_meta(done)

    # ---- results -------------------------------------------------------------------

    def on_result(self, result: StepResult) -> ResultEvents | None:
        """Asynchronous loads that ended: ready requests go first in the queue, failed
        ones recompute (requeued too) or fail."""
        stats = result.kv_transfer
        if stats is None:
            return None
        self.connector.on_step_result(stats)
        remote = self.remote_loads
        if remote is None or not (stats.finished_loading or stats.failed_loading):
            return None
        outcomes = remote.on_outcomes(stats.finished_loading, stats.failed_loading)
        self.connector.counters.num_load_failures = remote.num_failures
        return ResultEvents(outcomes.ready + outcomes.recompute, outcomes.failed, LOAD_FAILED)

    # ---- leaving -------------------------------------------------------------------

    def on_finish(self, request: Request) -> None:
        remote = self.remote_loads
        if remote is not None:
            if request.request_id in remote.loading:
                remote.abandon(request)  # its blocks: when the pull ends
            remote.forget(request)
        self.connector.request_finished(request)

    def on_worker_lost(self) -> list[Request]:
        if self.remote_loads is None:
            return []
        return self.remote_loads.drop_all()

    def has_background_work(self) -> bool:
        # An aborted request still loading counts: steps must go on to hear the pull end.
        return self.remote_loads is not None and bool(self.remote_loads.loading)

    def add_stats(self, stats: FeatureStats) -> None:
        stats.kv_transfer = self.connector.take_stats()
        if self.remote_loads is not None:
            stats.kv_transfer.num_waiting_for_remote_kv = len(self.remote_loads)

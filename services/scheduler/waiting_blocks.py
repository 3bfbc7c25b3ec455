"""KV blocks for a waiting request's first chunk: its prefix-cache hit, what a step
feature loads from outside (a KV transfer), then the chunk this step computes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.services.scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import StepFeature

# (request, token budget) -> tokens it may compute this step (Scheduler._num_new_tokens)
NewTokens = Callable[[Request, int], int]


def allocate_waiting(
    request: Request,
    budget: int,
    kv_cache: KVCacheManager,
    features: Sequence[StepFeature],
    num_new_tokens: NewTokens,
) -> tuple[int, bool] | None:
    """(tokens to compute, parked until an asynchronous load ends), or None (nothing
    changed) when the request cannot start now."""
    if kv_cache.get_block_ids(request.request_id):  # KV loaded for it (or forked)
        num_new = num_new_tokens(request, budget)
        if num_new == 0 or kv_cache.allocate_slots(request, num_new) is None:
            return None
        return num_new, False
    computed = ComputedBlocks([], 0)
    if all(f.reads_prefix_cache(request) for f in features):
        computed = kv_cache.get_computed_blocks(request)
    externals = [f.admission(request, computed) for f in features]
    if None in externals:
        return None
    external = next((e for e in externals if e and e.num_tokens), None)
    num_external = 0 if external is None else external.num_tokens
    parked = external is not None and external.parked
    num_local = computed.num_computed_tokens
    request.num_computed_tokens = num_local + num_external
    num_new = 0 if parked else num_new_tokens(request, budget)
    # allocate_slots counts a new request's KV from its local hit alone.
    request.num_computed_tokens = num_local
    nothing = num_new == 0 and not parked and not num_external  # (a feature's cap)
    num_slots = num_external + num_new
    if nothing or kv_cache.allocate_slots(request, num_slots, computed) is None:
        request.num_computed_tokens = 0
        return None
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = num_local
    if external is not None:
        request.num_computed_tokens += num_external
        for f in features:
            f.on_allocated(request, num_local, external)
    return num_new, parked

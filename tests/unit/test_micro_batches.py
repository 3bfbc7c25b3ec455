"""Pipeline parallelism's scheduling rules (services/scheduler/micro_batches.py).

The engine core runs with P plans in flight against two fake stages: the last samples
(test_engine_core's FakeWorker), the first never does and knows a request's tokens only
from the plans (the prompt, then `new_token_ids`), as a real first stage does. Every
plan must be computable by the first stage, no request may be in two plans in flight,
and the tokens must be those of one step at a time.
"""

from __future__ import annotations

from collections import deque

import pytest
from test_engine_core import EOS_AFTER, WORKLOAD, FakeWorker, _collect, add, make_core, run

from kvflow.config import SchedulerConfig
from kvflow.proto.step import StepPlan, StepResult
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.micro_batches import MicroBatches, MicroBatchFeature
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK_SIZE, VOCAB, MAX_MODEL_LEN, EOS = 4, 64, 48, 2


class FirstStage:
    """Knows tokens only from plans; checks that each step's inputs are known."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def run(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in plan.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
        computed = {new.req_id: new.num_computed_tokens for new in plan.new_requests}
        for cached in plan.cached_requests:
            tokens = self.tokens[cached.req_id]
            start = cached.num_computed_tokens
            tokens[start : start + len(cached.new_token_ids)] = cached.new_token_ids
            computed[cached.req_id] = start
        for req_id, forced in plan.forced_token_ids.items():
            self.tokens[req_id].extend(forced)
        for req_id, count in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            end = computed[req_id] + count
            assert end <= len(self.tokens[req_id]), f"{req_id}: stage 0 lacks a token"


def pipeline_core(depth: int, num_blocks: int = 64, max_num_seqs: int = 256) -> EngineCore:
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_num_seqs)
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    limits = EngineLimits(VOCAB, MAX_MODEL_LEN, BLOCK_SIZE, num_blocks, frozenset({EOS}))
    features = make_step_features(config, kv_cache, MAX_MODEL_LEN, pipeline_depth=depth)
    scheduler = Scheduler(config, kv_cache, MAX_MODEL_LEN, features=features)
    return EngineCore(scheduler, limits, depth)


def run_pipeline(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Drive the core as the engine does; returns tokens, finish reasons, max depth."""
    first, last = FirstStage(), FakeWorker(EOS_AFTER)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    results: deque[StepResult] = deque()
    max_depth = 0
    while core.has_unfinished_requests() or core.in_flight:
        while core.can_schedule():
            plan = core.schedule(now=0.0)
            if plan is None:
                break
            in_flight = [set(s.plan.scheduled_req_ids) for s in core.in_flight]
            assert sum(map(len, in_flight)) == len(set().union(*in_flight)), "in two plans"
            first.run(plan)
            results.append(last.execute(plan))
        max_depth = max(max_depth, len(core.in_flight))
        _, deltas = core.update(results.popleft(), now=0.0)
        _collect(deltas, tokens, finished)
    core.scheduler.kv_cache.check_integrity()
    assert core.scheduler.kv_cache.num_free_blocks == core.scheduler.kv_cache.num_blocks
    return tokens, finished, max_depth


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("core_options", [{}, {"num_blocks": 12}, {"max_num_seqs": 2}])
def test_p_micro_batches_give_the_tokens_of_one_step_at_a_time(
    depth: int, core_options: dict[str, int]
) -> None:
    """12 blocks force preemptions (of requests in flight, too); 2 seqs queue requests."""
    want_core = make_core(1, **core_options)
    core = pipeline_core(depth, **core_options)
    for req_id, (prompt, params) in WORKLOAD.items():
        add(want_core, req_id, prompt, **params)
        add(core, req_id, prompt, **params)
    want = run(want_core, FakeWorker(EOS_AFTER))
    tokens, finished, max_depth = run_pipeline(core)
    assert (tokens, finished) == want
    # Two running requests fill two micro-batches at most.
    assert max_depth == min(depth, core_options.get("max_num_seqs", depth))
    if "num_blocks" in core_options:
        assert core.scheduler.num_preemptions > 0
    feature = core.scheduler.feature(MicroBatchFeature)
    assert feature is not None
    assert feature.micro_batches.in_flight == set()


def test_decodes_split_over_the_micro_batches() -> None:
    core = pipeline_core(2)
    for index in range(5):
        add(core, f"r{index}", [5 + index, 6, 7], max_tokens=20, ignore_eos=True)
    worker = FakeWorker()
    prefill = core.schedule(now=0.0)  # all five prompts fit the budget: one step
    assert prefill is not None and len(prefill.scheduled_req_ids) == 5
    assert core.schedule(now=0.0) is None  # every request is in flight
    core.update(worker.execute(prefill), now=0.0)
    first = core.schedule(now=0.0)
    second = core.schedule(now=0.0)
    assert first is not None and second is not None
    assert first.scheduled_req_ids == ["r0", "r1", "r2"]  # ceil(5 / 2)
    assert second.scheduled_req_ids == ["r3", "r4"]
    assert [c.new_token_ids for c in first.cached_requests] == [
        worker.tokens[r][-1:] for r in first.scheduled_req_ids
    ]
    assert not core.can_schedule()  # two in flight: the pipeline is full
    core.update(worker.execute(first), now=0.0)
    third = core.schedule(now=0.0)
    assert third is not None and third.scheduled_req_ids == ["r0", "r1", "r2"]


def test_one_step_depth_sends_no_tokens() -> None:
    """Without pipeline stages plans stay as they were: no new_token_ids on the wire."""
    core = make_core(2)
    add(core, "r", [5, 6, 7], max_tokens=4)
    worker = FakeWorker()
    plan = core.schedule(now=0.0)
    assert plan is not None
    core.update(worker.execute(plan), now=0.0)
    plan = core.schedule(now=0.0)
    assert plan is not None and plan.cached_requests[0].new_token_ids == []
    assert core.scheduler.feature(MicroBatchFeature) is None


def test_decode_cap_is_a_ceiling_and_never_zero() -> None:
    micro = MicroBatches(3)
    assert [micro.decode_cap(n) for n in (0, 1, 3, 4, 7)] == [1, 1, 1, 2, 3]

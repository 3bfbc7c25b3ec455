"""Scheduler core: exact plans for hand-made situations, no model involved."""

from __future__ import annotations

import random

from kvflow.config import SchedulerConfig
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK = 4
EOS = 0


def make_scheduler(
    num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, **kwargs: object
) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kwargs)  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, True), max_model_len=1024)


def make_request(
    req_id: str, prompt_len: int, max_tokens: int = 8, start: int = 100, **kwargs: object
) -> Request:
    prompt = list(range(start, start + prompt_len))
    params = SamplingParams(max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]
    return Request(req_id, prompt, params, eos_token_ids=frozenset({EOS}), max_tokens=max_tokens)


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[StepPlan, list]:
    """Schedule, 'sample' `token` for every request that reaches its end, apply."""
    plan = scheduler.schedule()
    sampled = []
    for req_id in plan.scheduled_req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens == request.num_tokens:
            sampled.append(req_id)
    result = StepResult(
        step_id=plan.step_id, req_ids=sampled, sampled_token_ids=[[token] for _ in sampled]
    )
    return plan, scheduler.update_from_output(plan, result)


def test_one_budget_chunks_the_prompt_that_does_not_fit() -> None:
    scheduler = make_scheduler(budget=12)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 6, start=300))
    plan, deltas = run_step(scheduler)
    assert plan.scheduled_req_ids == ["a", "b"]
    assert plan.num_scheduled_tokens == [10, 2]
    assert [d.req_id for d in deltas] == ["a"]  # b's chunk stops short: nothing sampled
    plan, deltas = run_step(scheduler)
    # decode of a first, then the rest of b's prompt
    assert plan.scheduled_req_ids == ["a", "b"]
    assert plan.num_scheduled_tokens == [1, 4]
    assert [c.req_id for c in plan.cached_requests] == ["a", "b"]
    assert plan.cached_requests[1].num_computed_tokens == 2
    assert {d.req_id for d in deltas} == {"a", "b"}


def test_new_requests_travel_in_full_once_then_as_deltas() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    plan, _ = run_step(scheduler)
    assert [n.req_id for n in plan.new_requests] == ["a"]
    assert plan.new_requests[0].token_ids == list(range(100, 105))
    assert plan.new_requests[0].block_ids == [0, 1]
    plan, _ = run_step(scheduler)
    assert plan.new_requests == []
    assert plan.cached_requests[0].new_block_ids == []  # 6 tokens still fit 2 blocks
    run_step(scheduler)
    run_step(scheduler)
    plan, _ = run_step(scheduler)  # computing token #9 needs a third block
    assert plan.cached_requests[0].new_block_ids == [2]


def test_long_prefill_threshold_lets_short_prompts_through() -> None:
    scheduler = make_scheduler(budget=64, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("long", 40))
    scheduler.add_request(make_request("short", 3, start=500))
    plan, deltas = run_step(scheduler)
    assert plan.num_scheduled_tokens == [8, 3]
    assert [d.req_id for d in deltas] == ["short"]


def test_max_tokens_and_eos_finish_and_free_blocks() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    finished = []
    for _ in range(3):
        _, deltas = run_step(scheduler)
        finished += [d for d in deltas if d.finish_reason]
    assert [(d.req_id, d.finish_reason) for d in finished] == [("a", "length")]
    assert scheduler.kv_cache.num_free_blocks == 64
    scheduler.add_request(make_request("b", 4, start=900))
    _, deltas = run_step(scheduler, token=EOS)
    assert deltas[0].finish_reason == "stop"
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["b"]  # the worker is told to forget it


def test_min_tokens_suppresses_eos_stop() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=5, min_tokens=2))
    _, deltas = run_step(scheduler, token=EOS)
    assert deltas[0].finish_reason is None
    _, deltas = run_step(scheduler, token=EOS)
    assert deltas[0].finish_reason == "stop"


def test_stop_token_ids_report_the_stop_reason() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, stop_token_ids=[7]))
    _, deltas = run_step(scheduler, token=7)
    assert (deltas[0].finish_reason, deltas[0].stop_reason) == ("stop", 7)


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks; computing
    # token #13 of both needs 8, so the newest (b) is preempted.
    scheduler = make_scheduler(num_blocks=6, budget=64)
    scheduler.add_request(make_request("a", 8, max_tokens=20))
    scheduler.add_request(make_request("b", 8, max_tokens=20, start=300))
    for _ in range(5):
        run_step(scheduler)  # both have 12 computed tokens (3 full blocks each)
    plan, _ = run_step(scheduler)
    assert scheduler.num_preemptions == 1
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert plan.scheduled_req_ids == ["a"]
    assert "b" in plan.finished_req_ids  # the worker drops its copy
    scheduler.kv_cache.check_integrity()


def test_preempted_request_resumes_with_its_outputs() -> None:
    scheduler = make_scheduler(num_blocks=6, budget=64)
    scheduler.add_request(make_request("a", 8, max_tokens=6))
    scheduler.add_request(make_request("b", 8, max_tokens=20, start=300))
    resumed = None
    for _ in range(12):
        plan, _ = run_step(scheduler)
        for new in plan.new_requests:
            if new.req_id == "b" and len(new.token_ids) > 8:
                resumed = new
    assert resumed is not None
    assert resumed.num_prompt_tokens == 8
    assert resumed.token_ids[8:] == [7] * (len(resumed.token_ids) - 8)


def test_priority_policy_serves_lower_value_first() -> None:
    scheduler = make_scheduler(budget=4, max_seqs=1, policy="priority")
    low = make_request("low", 3)
    low.priority = 5
    high = make_request("high", 3, start=400)
    high.priority = -1
    scheduler.add_request(low)
    scheduler.add_request(high)
    plan, _ = run_step(scheduler)
    assert plan.scheduled_req_ids == ["high"]


def test_abort_frees_blocks_and_tells_the_worker() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("w", 10, start=600))
    run_step(scheduler)
    scheduler.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == 64
    assert set(scheduler.schedule().finished_req_ids) == {"a", "w"}


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9, max_tokens=1))
    run_step(scheduler)  # a finishes; its two full blocks stay cached
    scheduler.add_request(make_request("b", 10, max_tokens=1))
    plan, deltas = run_step(scheduler)
    assert plan.new_requests[0].num_computed_tokens == 8
    assert plan.num_scheduled_tokens == [2]
    assert deltas[0].num_cached_tokens == 8


def test_random_workload_never_leaks_blocks() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=40, budget=24, max_seqs=6)
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.3:
            stem = rng.choice([100, 200])
            scheduler.add_request(
                make_request(f"r{next_id}", rng.randint(1, 30), rng.randint(1, 12), start=stem)
            )
            next_id += 1
        if rng.random() < 0.05 and scheduler.requests:
            victim = rng.choice(list(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        run_step(scheduler, token=rng.choice([EOS, 5, 6]))
        scheduler.kv_cache.check_integrity()
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 40

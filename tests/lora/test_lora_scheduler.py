"""The scheduler's LoRA rules on hand-made requests: at most max_loras adapters among
the running requests, others pass them, and a passed-over request cannot starve."""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.proto.lora import LoRARequest
from kvflow.proto.step import StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.lora_feature import LoraFeature
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.scheduler import Scheduler


def _scheduler(max_loras: int, patience: int = 3) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    features = [LoraFeature(max_loras, patience)]
    return Scheduler(config, KVCacheManager(64, 4, True), 1024, features=features)


def _request(req_id: str, lora_id: int, max_tokens: int = 4) -> Request:
    lora = LoRARequest(f"lora{lora_id}", lora_id, "/x") if lora_id else None
    params = SamplingParams(max_tokens=max_tokens)
    return Request(req_id, [1, 2, 3], params, max_tokens=max_tokens, lora_request=lora)


def _step(scheduler: Scheduler) -> list[str]:
    """Plan one step, sample token 7 for every request at its end; the planned ids."""
    plan = scheduler.schedule()
    sampled = [
        r for r in plan.scheduled_req_ids
        if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens
    ]  # fmt: skip
    result = StepResult(plan.step_id, sampled, [[7] for _ in sampled])
    scheduler.update_from_output(plan, result)
    return plan.scheduled_req_ids


def _adapters(scheduler: Scheduler, req_ids: list[str]) -> set[int]:
    return {scheduler.requests[r].lora_int_id for r in req_ids if r in scheduler.requests} - {0}


def test_at_most_max_loras_adapters_run_and_the_base_passes() -> None:
    scheduler = _scheduler(max_loras=1)
    for req_id, lora_id in (("a", 1), ("b", 2), ("base", 0), ("c", 1)):
        scheduler.add_request(_request(req_id, lora_id))
    planned = _step(scheduler)
    assert planned == ["a", "base", "c"]  # b's adapter would be a second: it waits
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    stats = scheduler.snapshot().features.lora
    assert stats is not None and stats.running == ["lora1"] and stats.waiting == ["lora2"]
    while scheduler.requests:
        planned = _step(scheduler)
        assert len(_adapters(scheduler, planned)) <= 1
    assert "b" not in scheduler.requests  # it ran once lora1 drained


def test_a_passed_over_request_holds_the_queue_after_patience() -> None:
    scheduler = _scheduler(max_loras=1, patience=2)
    scheduler.add_request(_request("a", 1, max_tokens=50))
    _step(scheduler)
    scheduler.add_request(_request("b", 2))
    for step in range(2):  # passed over twice, while new lora1 requests start
        scheduler.add_request(_request(f"new{step}", 1, max_tokens=50))
        assert f"new{step}" in _step(scheduler)
    scheduler.add_request(_request("late", 1, max_tokens=50))
    assert "late" not in _step(scheduler)  # b holds the queue now
    while "b" in scheduler.requests and scheduler.requests["b"].num_computed_tokens == 0:
        _step(scheduler)
    assert "late" in scheduler.requests  # it waited behind b, and b got its turn

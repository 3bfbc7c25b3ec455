"""Admission hold (services/scheduler/admission_hold.py): closed-loop waves of 1 + 7
prompts merge into one prefill step with the hold on and stay split without it; the
hold never outlasts its bound and never touches a batch whose prompts all came first."""

from __future__ import annotations

import pytest
from test_scheduler import make_request, run_step

from kvflow.config import SchedulerConfig
from kvflow.errors import ConfigError
from kvflow.services.scheduler.admission_hold import AdmissionHoldFeature
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.scheduler import Scheduler

STEP_S = 0.01  # the fake clock's step time
MAX_TOKENS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(hold_s: float, clock: Clock) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
    features = [AdmissionHoldFeature(hold_s, clock)] if hold_s else []
    return Scheduler(config, KVCacheManager(256, 4, False), 1024, features=features)


def closed_loop(hold_s: float, waves: int) -> list[int]:
    """8 clients, each sending its next 8-token prompt when its previous request
    finished; the first arrives alone, the 7 others one step later. Returns the number of
    prompts each step admitted (steps that admitted none left out)."""
    clock = Clock()
    scheduler = make(hold_s, clock)
    sent = {"n": 0}

    def send() -> None:
        sent["n"] += 1
        scheduler.add_request(make_request(f"r{sent['n']}", 8, MAX_TOKENS, start=100))

    send()
    admitted = []
    for step in range(200):
        plan, deltas = run_step(scheduler)
        clock.now += STEP_S
        if plan.new_requests:
            admitted.append(len(plan.new_requests))
        if step == 0:
            for _ in range(7):
                send()
        for delta in deltas:  # each finished client sends again (until the last wave)
            if delta.finish_reason is not None and sent["n"] < 8 * waves:
                send()
        if not scheduler.has_unfinished_requests():
            break
    return admitted


def test_waves_stay_split_without_the_hold() -> None:
    assert closed_loop(0.0, waves=4) == [1, 7, 1, 7, 1, 7, 1, 7]


def test_the_hold_merges_the_waves() -> None:
    # Wave 1 is split (nothing had finished: no arrival was due); from wave 2 on, the
    # lone prompt waits for the 7 that the finishing requests' clients send.
    assert closed_loop(0.05, waves=4) == [1, 7, 8, 8, 8]


def test_the_hold_is_bounded() -> None:
    clock = Clock()
    scheduler = make(0.05, clock)
    scheduler.add_request(make_request("a1", 8, max_tokens=1))
    scheduler.add_request(make_request("a2", 8, max_tokens=1, start=200))
    run_step(scheduler)  # both prefilled and finished: two clients are due to send again
    scheduler.add_request(make_request("b", 8, start=300))
    plan, _ = run_step(scheduler)
    assert plan.scheduled_req_ids == []  # b waits for the other arrival that is due
    hold = scheduler.feature(AdmissionHoldFeature)
    assert hold is not None and hold.holding
    clock.now += 0.049
    assert run_step(scheduler)[0].scheduled_req_ids == []
    clock.now += 0.002  # b has waited the whole hold: it goes, arrival or not
    assert run_step(scheduler)[0].scheduled_req_ids == ["b"]
    assert not hold.holding


def test_a_batch_queued_up_front_is_never_held() -> None:
    clock = Clock()
    scheduler = make(0.05, clock)
    for i, max_tokens in enumerate([1, 2, 3, 4]):
        scheduler.add_request(make_request(f"r{i}", 8, max_tokens, start=100 + 50 * i))
    scheduler.add_request(make_request("late", 8, start=400))
    counts = []
    while scheduler.has_unfinished_requests():
        plan, _ = run_step(scheduler)
        counts.append(len(plan.scheduled_req_ids))
        clock.now += STEP_S
    assert counts[0] == 5  # everything admitted in the first step


def test_negative_hold_is_refused() -> None:
    with pytest.raises(ConfigError, match="admission_hold"):
        SchedulerConfig(admission_hold=-1.0)

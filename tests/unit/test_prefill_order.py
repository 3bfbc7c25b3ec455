"""Prefill order: fcfs, or shortest with resuming requests first and a starvation
bound, alone and inside the scheduler."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from test_scheduler import make_request, make_scheduler, run_step

from kvflow.config import SchedulerConfig
from kvflow.errors import ConfigError
from kvflow.services.scheduler.prefill_order import MAX_BYPASSES, PrefillOrder
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.request_queue import FCFSQueue


def ids(requests: Iterable[Request]) -> list[str]:
    return [r.request_id for r in requests]


def queue_of(*requests: Request) -> FCFSQueue:
    queue = FCFSQueue()
    for request in requests:
        queue.push(request)
    return queue


def test_fcfs_reads_the_queue_head_as_the_step_pops_it() -> None:
    queue = queue_of(make_request("long", 40), make_request("short", 4))
    order = PrefillOrder("fcfs").admission_order(queue)
    assert next(order).request_id == "long"
    queue.push_front(make_request("preempted", 8))  # the head changed: it is read anew
    assert next(order).request_id == "preempted"
    queue.pop()
    queue.pop()
    assert next(order).request_id == "short"
    queue.pop()
    assert list(order) == []  # an empty queue ends it


def test_shortest_orders_by_remaining_prompt_then_arrival() -> None:
    queue = queue_of(make_request("a", 40), make_request("b", 4), make_request("c", 12))
    queue.push(make_request("d", 4, start=500))
    assert ids(PrefillOrder("shortest").admission_order(queue)) == ["b", "d", "c", "a"]


def test_shortest_keeps_resuming_requests_first() -> None:
    preempted = make_request("preempted", 40)
    preempted.status = RequestStatus.PREEMPTED
    queue = queue_of(preempted, make_request("short", 4))
    assert ids(PrefillOrder("shortest").admission_order(queue)) == ["preempted", "short"]


def test_a_request_passed_over_max_bypasses_steps_goes_first() -> None:
    policy = PrefillOrder("shortest")
    long = make_request("long", 40)
    for step in range(MAX_BYPASSES):
        short = make_request(f"s{step}", 4)
        order = policy.admission_order(queue_of(long, short))
        assert ids(order) == [short.request_id, "long"]
        policy.on_admitted([short])  # the step admits the short one only
    assert ids(policy.admission_order(queue_of(long, make_request("s", 4)))) == ["long", "s"]
    policy.on_admitted([long])
    assert ids(policy.admission_order(queue_of(make_request("x", 40), make_request("y", 4)))) == [
        "y",
        "x",
    ]


def test_config_refuses_shortest_with_priorities() -> None:
    with pytest.raises(ConfigError, match="policy fcfs only"):
        SchedulerConfig(prefill_order="shortest", policy="priority")


def test_scheduler_admits_the_shortest_prompts_within_the_budget() -> None:
    scheduler = make_scheduler(budget=16, prefill_order="shortest")
    scheduler.add_request(make_request("long", 20))
    scheduler.add_request(make_request("short", 6, start=300))
    scheduler.add_request(make_request("mid", 8, start=500))
    plan, deltas = run_step(scheduler)
    assert plan.scheduled_req_ids == ["short", "mid", "long"]
    assert plan.num_scheduled_tokens == [6, 8, 2]  # long's first chunk takes the rest
    assert ids(scheduler.waiting) == []
    assert {d.req_id for d in deltas} == {"short", "mid"}
    fcfs = make_scheduler(budget=16)
    for request in (make_request("long", 20), make_request("short", 6, start=300)):
        fcfs.add_request(request)
    plan, deltas = run_step(fcfs)
    assert plan.scheduled_req_ids == ["long"] and deltas == []


def test_aborted_waiting_request_is_forgotten_by_the_policy() -> None:
    scheduler = make_scheduler(budget=16, prefill_order="shortest", max_seqs=2)
    scheduler.add_request(make_request("running", 4))
    run_step(scheduler)
    scheduler.add_request(make_request("long", 20, start=300))
    scheduler.add_request(make_request("short", 4, start=500))
    plan, _ = run_step(scheduler)  # one free slot: short jumps long
    assert plan.scheduled_req_ids == ["running", "short"]
    assert scheduler.prefill._bypasses == {"long": 1}
    scheduler.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.prefill._bypasses == {}

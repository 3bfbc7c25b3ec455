"""Load shedding on the engine's waiting queue (queue_limits.py): max_waiting_requests
refuses with code queue_full, max_queue_delay fails a request that waited too long for
its first step with code queue_timeout; preempted requests never expire; every refused
or expired request's blocks are free and its owner is told."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest

from kvflow.config import SchedulerConfig
from kvflow.errors import ConfigError, QueueFullError
from kvflow.proto.engine import AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.step import StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.liveness import Liveness
from kvflow.services.scheduler.loop import Outputs, SchedulerLoop
from kvflow.services.scheduler.request import RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def make_core(num_blocks: int = 16, **config: Any) -> EngineCore:
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    scheduler_config = SchedulerConfig(max_num_batched_tokens=64, **config)
    scheduler = Scheduler(scheduler_config, kv_cache, max_model_len=32)
    limits = EngineLimits(100, 32, BLOCK_SIZE, num_blocks, frozenset({2}))
    return EngineCore(scheduler, limits)


def add(
    req_id: str, prompt: list[int] | None = None, params: SamplingParams = GREEDY
) -> AddRequest:
    return AddRequest(req_id, prompt or [5, 6, 7], params, 0.0, frontend_id=f"fe-{req_id}")


def result(core: EngineCore, token: int = 11) -> StepResult:
    plan = core.in_flight[0].plan
    ids = plan.scheduled_req_ids
    return StepResult(step_id=plan.step_id, req_ids=ids, sampled_token_ids=[[token]] * len(ids))


def test_config_refuses_limits_that_cannot_work() -> None:
    with pytest.raises(ConfigError, match="max_waiting_requests"):
        SchedulerConfig(max_waiting_requests=0)
    with pytest.raises(ConfigError, match="max_queue_delay"):
        SchedulerConfig(max_queue_delay=0.0)
    assert not SchedulerConfig().sheds_load and SchedulerConfig(max_queue_delay=1).sheds_load


def test_waiting_limit_is_exact_and_frees_as_requests_start() -> None:
    core = make_core(max_waiting_requests=2, max_num_seqs=1)
    core.add_request(add("a"), now=0.0)
    core.add_request(add("b"), now=0.0)
    with pytest.raises(QueueFullError, match="2 requests already wait"):
        core.add_request(add("c"), now=0.0)
    refused = core.error_delta(add("c"), "full")
    assert (refused.finish_reason, refused.error_code, refused.frontend_id) == (
        "error",
        "queue_full",
        "fe-c",
    )
    assert "c" not in core.owners and "c" not in core.scheduler.requests
    assert core.schedule(now=0.0) is not None  # "a" runs (max_num_seqs=1): one place frees
    core.add_request(add("c"), now=0.0)
    with pytest.raises(QueueFullError):
        core.add_request(add("d"), now=0.0)
    # Another refusal's text is not mistaken for a load refusal.
    assert core.error_delta(add("x"), "bad").error_code is None


def test_queue_delay_fails_only_requests_that_never_ran() -> None:
    core = make_core(max_queue_delay=5.0, max_num_seqs=1)
    core.add_request(add("a"), now=0.0)
    core.add_request(add("b"), now=1.0)
    core.add_request(add("c"), now=4.0)
    core.schedule(now=0.0)
    _, deltas = core.update(result(core), now=5.5)  # b waited 4.5 s, c 1.5 s
    assert [d.req_id for d in deltas] == ["a"]
    core.schedule(now=5.5)
    _, deltas = core.update(result(core), now=6.5)  # b: 5.5 s > 5 s
    expired = [d for d in deltas if d.finish_reason == "error"]
    assert [(d.req_id, d.error_code, d.frontend_id) for d in expired] == [
        ("b", "queue_timeout", "fe-b")
    ]
    assert "max_queue_delay" in (expired[0].error or "")
    assert "b" not in core.scheduler.requests and "b" not in core.owners
    assert [r.request_id for r in core.scheduler.waiting] == ["c"]
    core.scheduler.kv_cache.check_integrity()


def test_preempted_requests_do_not_expire() -> None:
    core = make_core(num_blocks=4, max_queue_delay=1.0)  # 16 tokens of KV
    longer = SamplingParams(max_tokens=6, temperature=0.0)
    core.add_request(add("a", list(range(5, 12)), longer), now=0.0)
    core.add_request(add("b", list(range(20, 27)), longer), now=0.0)
    b = core.scheduler.requests["b"]
    now = 0.0
    while b.status != RequestStatus.PREEMPTED:  # at 9 tokens, a 3rd block each
        assert core.schedule(now=now) is not None
        now += 0.1
        _, deltas = core.update(result(core), now=now)
        assert all(d.finish_reason is None for d in deltas)
    assert b in list(core.scheduler.waiting) and b.num_output_tokens > 0
    assert core.expire_waiting(now=100.0) == []
    assert "b" in core.scheduler.requests


def test_served_loop_sends_the_codes_to_the_owners() -> None:
    """Through the scheduler loop (its transport is unchanged): the refusal's code and
    the expiry's code reach the detokenizer channel."""
    core = make_core(max_waiting_requests=2, max_queue_delay=0.05, max_num_seqs=1)
    outputs = Outputs(plans=_Recorder(), detokenizer=_Recorder(), stats=_Recorder())
    inbox: queue.Queue[Any] = queue.Queue()
    loop = SchedulerLoop(core, outputs, inbox, Liveness(5.0, {0: 1e18}), "0")
    for req_id in "abcd":
        inbox.put(add(req_id))
    loop.run_once()  # a, b queued; c, d refused; a planned
    refused = _deltas(outputs)
    assert [(d.req_id, d.error_code) for d in refused] == [("c", "queue_full"), ("d", "queue_full")]
    time.sleep(0.1)
    inbox.put(result(core))
    loop.run_once()
    expired = [d for d in _deltas(outputs) if d.error_code == "queue_timeout"]
    assert [d.req_id for d in expired] == ["b"]


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any, *, to: bytes | None = None) -> None:
        self.sent.append(message)


def _deltas(outputs: Outputs) -> list[TokenDelta]:
    recorder = outputs.detokenizer
    assert isinstance(recorder, _Recorder)
    return [d for m in recorder.sent if isinstance(m, EngineOutputs) for d in m.deltas]

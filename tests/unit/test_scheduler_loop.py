"""The scheduler's busy loop without sockets: messages in through the inbox, what it
sends recorded per channel."""

from __future__ import annotations

import queue
from typing import Any

import msgspec

from kvflow.config import SchedulerConfig
from kvflow.proto.control import ProcessFailed, WorkerHeartbeat
from kvflow.proto.engine import (
    DETOKENIZER_PROMPT_TAIL,
    AbortRequests,
    AddRequest,
    EngineOutputs,
    TokenDelta,
)
from kvflow.proto.stats import SchedulerStats
from kvflow.proto.step import Shutdown, StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.liveness import Liveness, WorkerDisconnected
from kvflow.services.scheduler.loop import Outputs, SchedulerLoop
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
EOS = 2
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: msgspec.Struct, *, to: bytes | None = None) -> None:
        self.sent.append(message)


def make_loop(
    num_blocks: int = 16, steps_in_flight: int = 1
) -> tuple[SchedulerLoop, queue.Queue[Any], Outputs]:
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv_cache, max_model_len=32)
    limits = EngineLimits(100, 32, BLOCK_SIZE, num_blocks, frozenset({EOS}))
    core = EngineCore(scheduler, limits, steps_in_flight)
    outputs = Outputs(plans=Recorder(), detokenizer=Recorder(), stats=Recorder())
    inbox: queue.Queue[Any] = queue.Queue()
    loop = SchedulerLoop(core, outputs, inbox, Liveness(5.0, {0: 1e18}), "7")
    return loop, inbox, outputs


def sent(outputs: Outputs, channel: str) -> list[Any]:
    recorder = getattr(outputs, channel)
    assert isinstance(recorder, Recorder)
    return recorder.sent


def add(req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> AddRequest:
    return AddRequest(req_id, prompt, params, arrival_time=0.0, frontend_id=f"fe-{req_id}")


def deltas(outputs: Outputs) -> list[TokenDelta]:
    return [
        d for m in sent(outputs, "detokenizer") if isinstance(m, EngineOutputs) for d in m.deltas
    ]


def test_request_is_forwarded_planned_and_streamed() -> None:
    loop, inbox, outputs = make_loop()
    inbox.put(add("a", [5, 6, 7, 8, 9]))
    loop.run_once()
    assert sent(outputs, "detokenizer") == [add("a", [5, 6, 7, 8, 9])]
    (plan,) = sent(outputs, "plans")
    assert isinstance(plan, StepPlan)
    assert (plan.scheduled_req_ids, plan.num_scheduled_tokens) == (["a"], [5])
    assert plan.new_requests[0].block_ids == [0, 1]
    loop.run_once()  # the result is not there: no second plan
    assert len(sent(outputs, "plans")) == 1
    for step_id, token in ((1, 11), (2, 12), (3, 13)):
        inbox.put(StepResult(step_id=step_id, req_ids=["a"], sampled_token_ids=[[token]]))
        loop.run_once()
    got = deltas(outputs)
    assert [d.new_token_ids for d in got] == [[11], [12], [13]]
    assert [d.finish_reason for d in got] == [None, None, "length"]
    assert {d.frontend_id for d in got} == {"fe-a"}
    assert got[0].num_prompt_tokens == 5 and got[0].queued_time > 0
    assert loop.core.scheduler.kv_cache.usage == 0.0 and loop.core.owners == {}
    stats = loop.stats_message()
    assert (stats.engine, stats.num_steps, stats.num_prompt_tokens) == ("7", 3, 5)
    assert (stats.num_generation_tokens, stats.num_running) == (3, 0)


def test_rejected_request_gets_an_error_delta_and_the_loop_goes_on() -> None:
    loop, inbox, outputs = make_loop(num_blocks=4)  # 16 tokens of KV in all
    inbox.put(add("big", list(range(3, 20))))  # 17 + 3 tokens: more than the cache
    inbox.put(add("n2", [5], SamplingParams(n=2)))
    inbox.put(add("ok", [5, 6]))
    loop.run_once()
    kinds = [type(m).__name__ for m in sent(outputs, "detokenizer")]
    assert kinds == ["AddRequest", "EngineOutputs", "AddRequest", "EngineOutputs", "AddRequest"]
    errors = deltas(outputs)
    assert [(d.req_id, d.finish_reason, d.frontend_id) for d in errors] == [
        ("big", "error", "fe-big"),
        ("n2", "error", "fe-n2"),
    ]
    assert "needs 5 KV blocks but the cache holds 4" in (errors[0].error or "")
    assert "n=2" in (errors[1].error or "")
    (plan,) = sent(outputs, "plans")
    assert plan.scheduled_req_ids == ["ok"]


def test_abort_frees_blocks_and_sends_a_final_delta() -> None:
    loop, inbox, outputs = make_loop()
    inbox.put(add("a", [5, 6, 7, 8, 9]))
    loop.run_once()
    inbox.put(AbortRequests(["a", "unknown"]))
    loop.run_once()  # aborted while its step is in flight
    assert loop.core.scheduler.kv_cache.usage == 0.0
    assert [(d.req_id, d.finish_reason) for d in deltas(outputs)] == [("a", "abort")]
    inbox.put(StepResult(step_id=1, req_ids=["a"], sampled_token_ids=[[11]]))
    loop.run_once()
    assert len(deltas(outputs)) == 1  # the late token is not streamed
    loop.core.scheduler.kv_cache.check_integrity()


def test_stop_string_abort_sends_nothing_back() -> None:
    loop, inbox, outputs = make_loop()
    inbox.put(add("a", [5, 6]))
    loop.run_once()
    inbox.put(StepResult(step_id=1, req_ids=["a"], sampled_token_ids=[[11]]))
    inbox.put(AbortRequests(["a"], finish_reason="stop", stop_reason="xy"))
    loop.run_once()
    assert [d.finish_reason for d in deltas(outputs)] == [None]
    assert not loop.core.has_unfinished_requests()
    # The next plan tells the worker to forget it.
    inbox.put(add("b", [5, 6]))
    loop.run_once()
    assert sent(outputs, "plans")[-1].finished_req_ids == ["a"]


def test_duplicate_request_id_is_dropped() -> None:
    loop, inbox, outputs = make_loop()
    inbox.put(add("a", [5, 6]))
    inbox.put(add("a", [7, 8]))
    loop.run_once()
    assert len(sent(outputs, "detokenizer")) == 1
    assert loop.core.scheduler.num_unfinished_requests == 1


def test_stats_are_published_even_when_idle() -> None:
    loop, _, outputs = make_loop()
    loop.run_once()
    (stats,) = sent(outputs, "stats")
    assert isinstance(stats, SchedulerStats)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_shutdown_ends_the_loop() -> None:
    loop, inbox, _ = make_loop()
    inbox.put(Shutdown())
    loop.run_once()
    assert loop.finished and loop.dead_reason is None


def test_a_failed_worker_is_waited_for_not_fatal() -> None:
    loop, inbox, outputs = make_loop()
    inbox.put(ProcessFailed("worker", 0, "CUDA error"))
    loop.run_once()
    assert not loop.finished
    assert loop.recovery.reason == "worker rank 0 failed: CUDA error"
    stats = [m for m in sent(outputs, "stats") if isinstance(m, SchedulerStats)]
    assert stats[-1].recovering == "worker rank 0 failed: CUDA error"


def test_liveness_silence_and_dropped_connections() -> None:
    liveness = Liveness(5.0, {0: 100.0, 1: 100.0})
    assert liveness.dead_reason(104.0) is None
    assert liveness.dead_reason(105.5) == "worker rank 0 sent no heartbeat for 5 s"
    liveness = Liveness(5.0, {0: 100.0, 1: 100.0})
    liveness.suspect(100.5)
    liveness.beat(1, 101.0)  # rank 1 is alive; rank 0 went away
    assert liveness.dead_reason(101.5) is None
    assert liveness.dead_reason(102.1) == "worker rank 0 dropped its connection and went silent"
    liveness.beat(0, 102.2)  # it was a reconnect after all
    assert liveness.dead_reason(102.3) is None and liveness.suspect_since is None


def test_heartbeats_and_disconnects_reach_liveness() -> None:
    loop, inbox, _ = make_loop()
    loop.liveness.last_seen[0] = 0.0
    inbox.put(WorkerHeartbeat(0, 0.0))
    inbox.put(WorkerDisconnected())
    loop.run_once()
    assert loop.liveness.last_seen[0] > 0.0 and loop.liveness.suspect_since is not None
    assert loop.dead_reason is None


def test_async_loop_sends_the_next_plan_before_the_result_and_stops_on_time() -> None:
    loop, inbox, outputs = make_loop(steps_in_flight=2)
    inbox.put(add("a", [5, 6, 7, 8, 9]))  # max_tokens 3
    loop.run_once()
    plans = sent(outputs, "plans")
    assert [p.num_scheduled_tokens for p in plans] == [[5], [1]]  # step 2 rides on step 1
    for step_id, token in ((1, 11), (2, 12), (3, 13)):
        inbox.put(StepResult(step_id=step_id, req_ids=["a"], sampled_token_ids=[[token]]))
        loop.run_once()
    # Step 3 was planned on the placeholder of token 2; nothing is planned past max_tokens.
    assert [p.step_id for p in sent(outputs, "plans") if p.scheduled_req_ids] == [1, 2, 3]
    got = deltas(outputs)
    assert [d.new_token_ids for d in got] == [[11], [12], [13]]
    assert [d.finish_reason for d in got] == [None, None, "length"]
    assert loop.core.scheduler.kv_cache.usage == 0.0 and not loop.core.in_flight


def test_only_the_prompt_tail_is_forwarded_to_the_detokenizer() -> None:
    loop, inbox, outputs = make_loop()
    prompt = list(range(3, 3 + DETOKENIZER_PROMPT_TAIL + 10))
    inbox.put(add("a", prompt))
    loop.run_once()
    (forwarded,) = sent(outputs, "detokenizer")
    assert forwarded.prompt_token_ids == prompt[-DETOKENIZER_PROMPT_TAIL:]
    (plan,) = sent(outputs, "plans")
    assert plan.new_requests[0].token_ids == prompt  # the worker gets all of it

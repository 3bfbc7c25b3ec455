"""The scheduler loop across a worker crash, without sockets: steps in flight dropped,
requests preempted and resumed by recomputation after a new worker answers a new hello,
results of the lost worker ignored, and the counts the stats carry."""

from __future__ import annotations

import time
from typing import Any

from test_scheduler_loop import add, deltas, make_loop, sent

from kvflow.proto.control import ProcessFailed, WorkerHeartbeat, WorkerInfo
from kvflow.proto.stats import SchedulerStats
from kvflow.proto.step import SchedulerHello, StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.loop import SchedulerLoop
from kvflow.services.scheduler.recovery import WorkerRecovery

LONG = SamplingParams(max_tokens=6, temperature=0.0)


def plans(outputs: Any) -> list[StepPlan]:
    return [m for m in sent(outputs, "plans") if isinstance(m, StepPlan)]


def hellos(outputs: Any) -> list[str]:
    return [m.incarnation for m in sent(outputs, "plans") if isinstance(m, SchedulerHello)]


def answer(loop: SchedulerLoop, hello_id: str, num_blocks: int = 16) -> None:
    loop.inbox.put(WorkerInfo(0, num_blocks, 100, 32, incarnation=hello_id))
    loop.run_once()


def result(plan: StepPlan, tokens: dict[str, int]) -> StepResult:
    sampled = [r for r in plan.scheduled_req_ids if r in tokens]
    return StepResult(plan.step_id, sampled, [[tokens[r]] for r in sampled])


def lose_worker(loop: SchedulerLoop) -> None:
    loop.inbox.put(ProcessFailed("worker", 0, "killed"))
    loop.run_once()


def test_requests_resume_where_they_stopped_with_two_steps_in_flight() -> None:
    loop, inbox, outputs = make_loop(steps_in_flight=2)
    loop.incarnation = loop.recovery.incarnation = "s1"
    inbox.put(add("a", [5, 6, 7, 8, 9], LONG))
    inbox.put(add("b", [3, 4], LONG))
    loop.run_once()
    first, second = plans(outputs)  # step 2 planned on step 1's placeholders
    inbox.put(result(first, {"a": 11, "b": 21}))
    loop.run_once()
    lose_worker(loop)  # steps 2 and 3 were in flight: their samples never come
    assert loop.recovery.recovering and not loop.core.in_flight
    assert loop.core.scheduler.kv_cache.usage == 0.0
    num_plans = len(plans(outputs))
    # A late result of the lost worker's step is ignored, and nothing is planned.
    inbox.put(result(second, {"a": 99, "b": 99}))
    loop.run_once()
    assert len(plans(outputs)) == num_plans
    assert hellos(outputs) == ["s1.1"]
    answer(loop, "s1.1")
    assert not loop.recovery.recovering
    resumed = plans(outputs)[num_plans]
    by_id = {r.req_id: r for r in resumed.new_requests}
    # Recomputed from the prompt plus the token already streamed.
    assert by_id["a"].token_ids == [5, 6, 7, 8, 9, 11] and by_id["a"].num_computed_tokens == 0
    assert by_id["b"].token_ids == [3, 4, 21]
    assert resumed.num_scheduled_tokens == [6, 3]
    streamed = [d.new_token_ids for d in deltas(outputs) if d.req_id == "a"]
    assert streamed == [[11]]  # nothing duplicated, nothing lost so far
    inbox.put(result(resumed, {"a": 12, "b": 22}))
    loop.run_once()
    streamed = [d.new_token_ids for d in deltas(outputs) if d.req_id == "a"]
    assert streamed == [[11], [12]]
    stats = loop.stats_message()
    assert (stats.num_worker_restarts, stats.num_resumed_requests, stats.recovering) == (1, 2, "")


def test_an_answer_to_an_old_hello_does_not_end_the_recovery() -> None:
    loop, inbox, outputs = make_loop()
    loop.recovery = WorkerRecovery("s1")
    inbox.put(add("a", [5, 6, 7], LONG))
    loop.run_once()
    lose_worker(loop)
    answer(loop, "s1")  # the start-up hello's id (e.g. a slow old worker)
    answer(loop, "s0.1")  # another scheduler's
    assert loop.recovery.recovering
    loop.recovery.next_hello = 0.0
    loop.run_once()
    assert hellos(outputs) == ["s1.1", "s1.2"]
    answer(loop, "s1.1")  # an earlier hello of this recovery is as good
    assert not loop.recovery.recovering
    assert plans(outputs)[-1].new_requests[0].token_ids == [5, 6, 7]


def test_silence_starts_a_recovery_and_a_long_one_is_fatal() -> None:
    loop, _, _ = make_loop()
    loop.liveness.last_seen[0] = time.monotonic() - 10.0
    loop.run_once()
    assert loop.recovery.reason == "worker rank 0 sent no heartbeat for 5 s"
    assert not loop.finished
    loop.recovery.since -= loop.recovery.timeout_s + 1
    loop.run_once()
    assert loop.finished and loop.dead_reason is not None
    assert "no worker came back within" in loop.dead_reason


def test_a_worker_with_fewer_blocks_is_fatal() -> None:
    loop, _, outputs = make_loop(num_blocks=16)
    lose_worker(loop)
    answer(loop, hellos(outputs)[-1], num_blocks=8)
    assert loop.dead_reason is not None and "8 KV blocks" in loop.dead_reason


def test_stats_say_recovering_at_once() -> None:
    loop, _, outputs = make_loop()
    loop.run_once()
    lose_worker(loop)
    stats = [m for m in sent(outputs, "stats") if isinstance(m, SchedulerStats)]
    assert len(stats) == 2 and stats[-1].recovering == "worker rank 0 failed: killed"


def test_a_heartbeat_from_a_new_worker_process_starts_a_recovery() -> None:
    loop, inbox, outputs = make_loop()
    loop.worker_incarnations[0] = "w1"
    inbox.put(WorkerHeartbeat(0, 0.0, "w1"))
    loop.run_once()
    assert not loop.recovery.recovering
    inbox.put(WorkerHeartbeat(0, 0.0, "w2"))  # restarted before its silence was noticed
    loop.run_once()
    assert loop.recovery.reason == "worker rank 0 was restarted (a new process)"
    loop.inbox.put(
        WorkerInfo(0, 16, 100, 32, incarnation=hellos(outputs)[-1], worker_incarnation="w2")
    )
    loop.run_once()
    assert not loop.recovery.recovering and loop.worker_incarnations == {0: "w2"}


def heartbeats(loop: SchedulerLoop, *workers: tuple[int, str]) -> list[SchedulerHello]:
    for rank, worker in workers:
        loop.inbox.put(WorkerHeartbeat(rank, 0.0, worker))
    loop.run_once()
    return [m for m in sent(loop.outputs, "plans") if isinstance(m, SchedulerHello)]


def test_a_group_whose_rank_restarted_is_told_to_leave_it() -> None:
    """TP=2 in separate containers: rank 0 restarted while the group idled. Rank 1 (alive,
    in the old group) would hold the new rank 0 at the rendezvous for ever: every hello
    tells rank 1's process to exit; its own restart then is expected, not a new loss."""
    loop, _, _ = make_loop()
    loop.worker_incarnations[0] = "r0-old"
    assert heartbeats(loop, (0, "r0-old"), (1, "r1-old")) == []
    told = heartbeats(loop, (0, "r0-new"))  # it beats before its rendezvous
    assert loop.recovery.recovering and told and all(m.leave == ["r1-old"] for m in told)
    told = heartbeats(loop, (1, "r1-new"))  # rank 1 left and came back: nobody else leaves
    assert told[-1].leave == ["r1-old"]
    answer_id = told[-1].incarnation
    loop.inbox.put(WorkerInfo(0, 16, 100, 32, incarnation=answer_id, worker_incarnation="r0-new"))
    loop.run_once()
    assert not loop.recovery.recovering
    heartbeats(loop, (0, "r0-new"), (1, "r1-new"))
    assert not loop.recovery.recovering


def test_a_silent_rank_alone_makes_nobody_leave() -> None:
    """A rank silent for 5 s on a loaded machine may only be slow: its group is kept, and
    the hello is answered as before (leaving costs every rank a model load)."""
    loop, _, _ = make_loop()
    heartbeats(loop, (0, "r0"), (1, "r1"))
    lose_worker(loop)
    told = heartbeats(loop, (0, "r0"), (1, "r1"))
    assert loop.recovery.recovering and told and all(m.leave == [] for m in told)


def test_a_single_rank_engine_tells_nobody_to_leave() -> None:
    loop, _, _ = make_loop()
    loop.worker_incarnations[0] = "w1"
    heartbeats(loop, (0, "w1"))
    told = heartbeats(loop, (0, "w2"))
    assert loop.recovery.recovering and told and all(m.leave == [] for m in told)

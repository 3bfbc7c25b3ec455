"""EngineCore with steps in flight, driven by a fake worker whose results come late.

The fake worker keeps its own copy of every request's tokens from the plans (as the
real persistent batch does) and samples a token that depends on the whole history, so
a plan built on a wrong history, or a sample applied to the wrong request, changes
what follows. Depth 2 must give exactly depth 1's tokens and finish reasons.
"""

from __future__ import annotations

from collections import deque

import pytest

from kvflow.config import SchedulerConfig
from kvflow.proto.engine import AddRequest, TokenDelta
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
EOS = 2
VOCAB = 64
MAX_MODEL_LEN = 48


class FakeWorker:
    """Runs plans in order; a request's next token is a function of its history."""

    def __init__(self, eos_after: dict[str, int] | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_prompt: dict[str, int] = {}
        self.eos_after = eos_after or {}  # req_id -> output length that samples EOS

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in plan.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
            self.num_prompt[new.req_id] = new.num_prompt_tokens
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            self.computed[cached.req_id] = cached.num_computed_tokens
        req_ids, sampled = [], []
        for req_id, count in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            tokens = self.tokens[req_id]
            end = self.computed[req_id] + count
            assert end <= len(tokens), f"{req_id}: computes a token the worker does not have"
            self.computed[req_id] = end
            if end == len(tokens):
                token = self._next(req_id, tokens)
                tokens.append(token)
                req_ids.append(req_id)
                sampled.append([token])
        return StepResult(step_id=plan.step_id, req_ids=req_ids, sampled_token_ids=sampled)

    def _next(self, req_id: str, tokens: list[int]) -> int:
        if len(tokens) - self.num_prompt[req_id] == self.eos_after.get(req_id, -1):
            return EOS
        return 3 + (sum(tokens) * 31 + len(tokens)) % (VOCAB - 3)


def make_core(depth: int, num_blocks: int = 64, max_num_seqs: int = 256) -> EngineCore:
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_num_seqs)
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    limits = EngineLimits(VOCAB, MAX_MODEL_LEN, BLOCK_SIZE, num_blocks, frozenset({EOS}))
    return EngineCore(Scheduler(config, kv_cache, MAX_MODEL_LEN), limits, depth)


def add(core: EngineCore, req_id: str, prompt: list[int], **params: object) -> None:
    sampling = SamplingParams(temperature=0.0, **params)  # type: ignore[arg-type]
    core.add_request(AddRequest(req_id, prompt, sampling, arrival_time=0.0), now=0.0)


WORKLOAD: dict[str, tuple[list[int], dict[str, object]]] = {
    "length": ([5, 6, 7, 8, 9], {"max_tokens": 6}),
    "eos": ([11, 12, 13], {"max_tokens": 20}),  # the worker samples EOS as output #4
    "eos-ignored": ([11, 12, 13], {"max_tokens": 7, "ignore_eos": True}),
    "min-tokens": ([20, 21], {"max_tokens": 12, "min_tokens": 6}),  # EOS as #3 does not stop
    "long-prompt": (list(range(3, 30)), {"max_tokens": 3}),  # chunked: budget 16
    "one-token": ([40], {"max_tokens": 1}),
}
EOS_AFTER = {"eos": 3, "eos-ignored": 3, "min-tokens": 2}


def run(core: EngineCore, worker: FakeWorker) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Drive the core as the served loop does: plan while there is room, then apply
    the oldest result. Returns each request's tokens and finish reason."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    results: deque[StepResult] = deque()
    max_depth = 0
    while core.has_unfinished_requests() or core.in_flight:
        while core.can_schedule():
            plan = core.schedule(now=0.0)
            if plan is None:
                break
            results.append(worker.execute(plan))
        max_depth = max(max_depth, len(core.in_flight))
        _, deltas = core.update(results.popleft(), now=0.0)
        _collect(deltas, tokens, finished)
    assert max_depth == core.max_steps_in_flight
    core.scheduler.kv_cache.check_integrity()
    assert core.scheduler.kv_cache.num_free_blocks == core.scheduler.kv_cache.num_blocks
    return tokens, finished


def _collect(deltas: list[TokenDelta], tokens: dict[str, list[int]], finished: dict[str, str]):
    for delta in deltas:
        assert delta.req_id not in finished, f"{delta.req_id}: a delta after its last"
        tokens.setdefault(delta.req_id, []).extend(delta.new_token_ids)
        if delta.finish_reason is not None:
            finished[delta.req_id] = delta.finish_reason


def run_workload(depth: int, **core_options: int) -> tuple[dict, dict]:
    core = make_core(depth, **core_options)
    for req_id, (prompt, params) in WORKLOAD.items():
        add(core, req_id, prompt, **params)
    return run(core, FakeWorker(EOS_AFTER))


@pytest.mark.parametrize("core_options", [{}, {"num_blocks": 12}, {"max_num_seqs": 2}])
def test_two_steps_in_flight_give_the_tokens_of_one(core_options: dict[str, int]) -> None:
    """12 blocks of 4 tokens force preemptions; max_num_seqs=2 queues requests."""
    tokens, finished = run_workload(1, **core_options)
    assert (tokens, finished) == run_workload(2, **core_options)
    assert finished == {
        "length": "length",
        "eos": "stop",
        "eos-ignored": "length",
        "min-tokens": "length",
        "long-prompt": "length",
        "one-token": "length",
    }
    assert {r: len(t) for r, t in tokens.items()} == {
        "length": 6,
        "eos": 4,  # stops exactly at EOS: the token planned after it is never emitted
        "eos-ignored": 7,
        "min-tokens": 12,
        "long-prompt": 3,
        "one-token": 1,
    }
    assert tokens["eos"][-1] == EOS and tokens["min-tokens"][2] == EOS


def test_preemption_happens_with_steps_in_flight() -> None:
    core = make_core(2, num_blocks=12)
    for req_id, (prompt, params) in WORKLOAD.items():
        add(core, req_id, prompt, **params)
    run(core, FakeWorker(EOS_AFTER))
    assert core.scheduler.num_preemptions > 0


def test_stop_token_retires_request_one_step_late_without_an_extra_token() -> None:
    core = make_core(2)
    worker = FakeWorker({"r": 1})  # output #2 is the stop token
    add(core, "r", [7, 8, 9], max_tokens=10, stop_token_ids=[EOS], ignore_eos=True)
    first = core.schedule(now=0.0)  # prefill: samples output #1
    second = core.schedule(now=0.0)  # planned on the placeholder of output #1
    assert first is not None and second is not None
    assert second.scheduled_req_ids == ["r"] and len(core.in_flight) == 2
    results = deque([worker.execute(first), worker.execute(second)])
    first_result = results.popleft()
    _, deltas = core.update(first_result, now=0.0)
    assert [d.new_token_ids for d in deltas] == first_result.sampled_token_ids
    third = core.schedule(now=0.0)  # on the placeholder of output #2 (the stop token)
    assert third is not None
    results.append(worker.execute(third))
    _, deltas = core.update(results.popleft(), now=0.0)
    assert deltas[0].new_token_ids == [EOS] and deltas[0].finish_reason == "stop"
    assert deltas[0].stop_reason == EOS
    _, deltas = core.update(results.popleft(), now=0.0)
    assert deltas == []  # the sample after the stop token is dropped
    assert not core.has_unfinished_requests()


def test_no_step_is_planned_past_max_tokens() -> None:
    core = make_core(2)
    add(core, "r", [7, 8, 9], max_tokens=1)
    assert core.schedule(now=0.0) is not None
    assert not core.can_schedule() or core.schedule(now=0.0) is None


def test_abort_mid_step_frees_blocks_and_drops_the_sample() -> None:
    core = make_core(2)
    worker = FakeWorker()
    add(core, "a", [5, 6, 7, 8, 9], max_tokens=10)
    add(core, "b", [9, 8, 7], max_tokens=10)
    plan = core.schedule(now=0.0)
    assert plan is not None
    used = core.scheduler.kv_cache.num_free_blocks
    deltas = core.abort_requests(["a"])
    assert [(d.req_id, d.finish_reason) for d in deltas] == [("a", "abort")]
    assert core.scheduler.kv_cache.num_free_blocks == used + 2  # a's 2 blocks, at once
    _, deltas = core.update(worker.execute(plan), now=0.0)
    assert [d.req_id for d in deltas] == ["b"]
    nxt = core.schedule(now=0.0)
    assert nxt is not None and "a" in nxt.finished_req_ids
    core.scheduler.kv_cache.check_integrity()


def test_a_preempted_request_ignores_samples_planned_before_its_preemption() -> None:
    core = make_core(3, num_blocks=3, max_num_seqs=2)
    worker = FakeWorker()
    add(core, "old", [3, 4, 5, 6], max_tokens=8)
    add(core, "new", [7, 8, 9, 10], max_tokens=8)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    results: deque[StepResult] = deque()
    while core.has_unfinished_requests() or core.in_flight:
        while core.can_schedule() and (plan := core.schedule(now=0.0)) is not None:
            results.append(worker.execute(plan))
        _, deltas = core.update(results.popleft(), now=0.0)
        _collect(deltas, tokens, finished)
    assert core.scheduler.num_preemptions > 0
    reference = make_core(1, num_blocks=64)
    add(reference, "old", [3, 4, 5, 6], max_tokens=8)
    add(reference, "new", [7, 8, 9, 10], max_tokens=8)
    assert (tokens, finished) == run(reference, FakeWorker())


def test_results_must_arrive_in_order() -> None:
    core = make_core(2)
    add(core, "r", [7, 8, 9], max_tokens=5)
    first, second = core.schedule(now=0.0), core.schedule(now=0.0)
    assert first is not None and second is not None
    with pytest.raises(ValueError, match="not awaited"):
        core.update(StepResult(step_id=second.step_id, req_ids=[], sampled_token_ids=[]), 0.0)


def test_a_sample_planned_before_a_preemption_is_dropped_after_readmission() -> None:
    """Depth 3: "new" is preempted while its first sample is in flight, and admitted
    again (an abort made room) before that stale sample comes back."""
    core = make_core(3, num_blocks=3)
    worker = FakeWorker()
    add(core, "old", [3, 4, 5, 6], max_tokens=8)
    add(core, "new", [7, 8, 9, 10], max_tokens=3)
    results: deque[StepResult] = deque()
    for _ in range(2):  # 1: both prefill; 2: both decode, one block left: "new" preempted
        plan = core.schedule(now=0.0)
        assert plan is not None
        results.append(worker.execute(plan))
    assert core.scheduler.num_preemptions == 1 and "new" in plan.finished_req_ids
    core.abort_requests(["old"])
    readmitted = core.schedule(now=0.0)
    assert readmitted is not None and [n.req_id for n in readmitted.new_requests] == ["new"]
    results.append(worker.execute(readmitted))
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    while core.has_unfinished_requests() or core.in_flight:
        while core.can_schedule() and (plan := core.schedule(now=0.0)) is not None:
            results.append(worker.execute(plan))
        _, deltas = core.update(results.popleft(), now=0.0)
        _collect(deltas, tokens, finished)
    reference = make_core(1)
    add(reference, "new", [7, 8, 9, 10], max_tokens=3)
    assert ({"new": tokens["new"]}, {"new": finished["new"]}) == run(reference, FakeWorker())

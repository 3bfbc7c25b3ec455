"""The engine core with the pooling feature, driven by a fake worker (sans-IO, fast).

The fake worker returns, for a request whose prompt ends in a step, the bytes of the
float32 sum of the tokens it computed for it, so a chunk computed twice, a token that
was never computed (a cached prefix) or a computation past the prompt changes the
vector. Each request gets exactly one delta: "stop", no tokens, its vector.
"""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np
import pytest

from kvflow.config import SchedulerConfig
from kvflow.errors import InvalidRequestError, PromptTooLongError
from kvflow.pooling import PoolingSpec
from kvflow.proto.engine import AddRequest, TokenDelta
from kvflow.proto.step import StepPlan, StepResult, WorkerInput
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
VOCAB = 64
MAX_MODEL_LEN = 40


class FakePoolingWorker:
    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.sums: dict[str, float] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self.prompts.pop(req_id, None)
        for new in plan.new_requests:
            self.prompts[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.sums[new.req_id] = 0.0  # what this worker computes, a cached prefix not
        for cached in plan.cached_requests:
            assert self.computed[cached.req_id] == cached.num_computed_tokens
        req_ids, pooled = [], []
        for req_id, count in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            start, prompt = self.computed[req_id], self.prompts[req_id]
            assert start + count <= len(prompt), f"{req_id}: computes past its prompt"
            self.sums[req_id] += sum(prompt[start : start + count])
            self.computed[req_id] = start + count
            if start + count == len(prompt):
                req_ids.append(req_id)
                pooled.append(np.float32([self.sums[req_id]]).tobytes())
        return StepResult(
            plan.step_id, req_ids, [[] for _ in req_ids], pooled=pooled
        )  # fmt: skip


def make_core(depth: int, pooling_type: str, num_blocks: int = 64) -> EngineCore:
    config = SchedulerConfig(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    spec = PoolingSpec(pooling_type=pooling_type)  # type: ignore[arg-type]
    features = make_step_features(config, kv_cache, MAX_MODEL_LEN, pooling=spec)
    limits = EngineLimits(VOCAB, MAX_MODEL_LEN, BLOCK_SIZE, num_blocks, frozenset({2}), True)
    scheduler = Scheduler(config, kv_cache, MAX_MODEL_LEN, VOCAB, features)
    return EngineCore(scheduler, limits, depth)


def add(core: EngineCore, req_id: str, prompt: list[int]) -> None:
    core.add_request(AddRequest(req_id, prompt, SamplingParams(max_tokens=1), 0.0), now=0.0)


def run(core: EngineCore, worker: FakePoolingWorker) -> dict[str, TokenDelta]:
    """Drive the core as the served loop does; every request's one delta."""
    deltas: dict[str, TokenDelta] = {}
    results: deque[StepResult] = deque()
    while core.has_unfinished_requests() or core.in_flight:
        while core.can_schedule():
            plan = core.schedule(now=0.0)
            if plan is None:
                break
            results.append(worker.execute(plan))
        for delta in core.update(results.popleft(), now=0.0)[1]:
            assert delta.req_id not in deltas, f"{delta.req_id}: a delta after its last"
            deltas[delta.req_id] = delta
    core.scheduler.kv_cache.check_integrity()
    return deltas


def _vector(delta: TokenDelta) -> float:
    return float(np.frombuffer(delta.pooled, dtype="<f4")[0])


PROMPTS = {
    "full-context": [3 + i % 50 for i in range(MAX_MODEL_LEN)],  # fills the context
    "chunked": list(range(5, 30)),
    "short": [7],
}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 blocks: preemptions
def test_each_prompt_is_pooled_once_without_decoding(depth: int, num_blocks: int) -> None:
    core = make_core(depth, "MEAN", num_blocks)
    for req_id, prompt in PROMPTS.items():
        add(core, req_id, prompt)
    deltas = run(core, FakePoolingWorker())
    for req_id, prompt in PROMPTS.items():
        delta = deltas[req_id]
        assert (delta.finish_reason, delta.new_token_ids) == ("stop", [])
        assert _vector(delta) == sum(prompt)  # each token computed exactly once
        assert delta.num_prompt_tokens == len(prompt)
    assert (core.scheduler.num_preemptions > 0) == (num_blocks == 12)
    assert core.scheduler.kv_cache.num_free_blocks == num_blocks


def test_a_prompt_past_the_context_is_refused() -> None:
    core = make_core(1, "LAST")
    with pytest.raises(PromptTooLongError, match="context is 40 tokens"):
        add(core, "long", [5] * (MAX_MODEL_LEN + 1))
    with pytest.raises(InvalidRequestError, match="empty"):
        add(core, "empty", [])


@pytest.mark.parametrize(
    ("pooling_type", "reads_cache"), [("LAST", True), ("MEAN", False), ("CLS", False)]
)
def test_prefix_cache_is_read_by_last_pooling_only(pooling_type: str, reads_cache: bool) -> None:
    core = make_core(1, pooling_type)
    worker = FakePoolingWorker()
    prefix = list(range(10, 26))
    add(core, "first", [*prefix, 3])
    run(core, worker)
    add(core, "second", [*prefix, 4, 5])
    second = run(core, worker)["second"]
    assert (second.num_cached_tokens > 0) == reads_cache
    # Every token not cached is computed exactly once.
    assert _vector(second) == sum(([*prefix, 4, 5])[second.num_cached_tokens :])


def test_pooled_bytes_cross_the_wire_as_raw_bytes() -> None:
    vector = np.arange(4, dtype="<f4").tobytes()
    result = StepResult(1, ["a"], [[]], pooled=[vector])
    encoded = msgspec.msgpack.encode(result)
    assert vector in encoded  # msgpack bin: the bytes themselves, no per-float encoding
    decoded = msgspec.msgpack.decode(encoded, type=StepResult | WorkerInput)
    assert isinstance(decoded, StepResult) and decoded.pooled == [vector]
    delta = msgspec.msgpack.decode(
        msgspec.msgpack.encode(TokenDelta("a", [], pooled=vector)), type=TokenDelta
    )
    assert delta.pooled == vector

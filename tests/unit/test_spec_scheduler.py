"""The scheduler's side of speculative decoding, exactly: drafts go into the plan and
the token budget, their KV slots are allocated but never hashed, rejected positions are
rolled back, max_tokens and the context bound the drafts, the off-switches work, and a
request with a verification step in flight is not scheduled again until it returns."""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.spec_decode.speculator import Speculator
from kvflow.speculative_config import SpeculativeConfig

BLOCK = 4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # "... 1 2" then 3: the n-gram proposes "3 1 2 3 ..."


def make(k: int = 3, budget: int = 32, **spec: object) -> Scheduler:
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, **spec}
    )
    scheduler_config = SchedulerConfig(max_num_batched_tokens=budget)
    kv_cache = KVCacheManager(16, BLOCK, True)
    speculator = Speculator(config)
    features = make_step_features(scheduler_config, kv_cache, 64, speculator=speculator)
    return Scheduler(scheduler_config, kv_cache, max_model_len=64, features=features)


def add(
    scheduler: Scheduler,
    req_id: str = "r",
    max_tokens: int = 10,
    prompt: list[int] = PROMPT,
    **params: object,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    request = Request(req_id, list(prompt), sp, max_tokens=max_tokens)
    scheduler.add_request(request)
    return request


def apply(scheduler: Scheduler, plan: StepPlan, tokens: dict[str, list[int]]) -> None:
    req_ids = list(tokens)
    result = StepResult(plan.step_id, req_ids, [tokens[r] for r in req_ids])
    scheduler.update_from_output(plan, result)


def test_drafts_are_scheduled_hashed_never_and_rolled_back() -> None:
    scheduler = make()
    request = add(scheduler)
    apply(scheduler, scheduler.schedule(), {"r": [3]})  # prefill; tokens 1 2 3 1 2 3 1 2 3
    plan = scheduler.schedule()
    assert plan.spec_token_ids == {"r": [1, 2, 3]}
    assert plan.num_scheduled_tokens == [4]  # the last token + 3 drafts
    assert request.num_computed_tokens == 12 and request.num_spec_in_flight == 3
    kv = scheduler.kv_cache
    assert len(kv.get_block_ids("r")) == 3  # 12 positions
    # Hashed: the 2 blocks full of known tokens (9 known), not the drafts' block.
    cached = [kv.block_pool.blocks[b].block_hash is not None for b in kv.get_block_ids("r")]
    assert cached == [True, True, False]
    # Nothing is scheduled for it while its verification is in flight.
    assert scheduler.schedule().scheduled_req_ids == []
    apply(scheduler, plan, {"r": [1, 2, 9]})  # 2 drafts accepted, the 3rd replaced by 9
    assert request.all_token_ids == [*PROMPT, 3, 1, 2, 9]
    assert request.num_computed_tokens == 11  # the rejected position is not computed
    assert request.num_spec_in_flight is None
    counters = scheduler.speculator.counters  # type: ignore[union-attr]
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (
        1,
        3,
        2,
    )
    assert counters.accepted_per_pos == [1, 1, 0]
    kv.check_integrity()


def test_drafts_stop_short_of_max_tokens_and_the_budget() -> None:
    scheduler = make(k=4, budget=8)
    add(scheduler, max_tokens=3)
    apply(scheduler, scheduler.schedule(), {"r": [3]})  # 1 output; 2 more allowed
    add(scheduler, "b", prompt=list(range(20, 40)))  # its chunk takes what the drafts leave
    plan = scheduler.schedule()
    # max_tokens leaves room for 1 draft + 1 more token, whatever k says.
    assert plan.spec_token_ids == {"r": [1]}
    assert plan.num_scheduled_tokens == [2, 6]  # the drafts came out of the budget
    apply(scheduler, plan, {"r": [1, 2]})
    assert "r" not in scheduler.requests  # finished at exactly max_tokens
    assert scheduler.kv_cache.get_block_ids("r") == []


def test_opt_out_and_low_acceptance_switch_speculation_off() -> None:
    scheduler = make(k=2, acceptance_window=4, min_acceptance_rate=0.5)
    add(scheduler, "off", max_tokens=20, speculative=False)
    add(scheduler, "low", max_tokens=20)
    apply(scheduler, scheduler.schedule(), {"off": [3], "low": [3]})
    for _ in range(2):  # two steps with every draft rejected: 4 drafted, 0 accepted
        plan = scheduler.schedule()
        assert list(plan.spec_token_ids) == ["low"]
        apply(scheduler, plan, {"off": [3], "low": [3]})  # the drafts 1 2 rejected
    for _ in range(4):  # cooling down: plain decodes for acceptance_window steps
        plan = scheduler.schedule()
        assert plan.spec_token_ids == {} and plan.num_scheduled_tokens == [1, 1]
        apply(scheduler, plan, {"off": [3], "low": [3]})
    assert scheduler.schedule().spec_token_ids != {}  # then it tries again


def test_low_acceptance_backs_off_longer_after_each_failed_window() -> None:
    config = SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "acceptance_window": 4,
            "min_acceptance_rate": 0.5,
        }
    )
    speculator = Speculator(config)

    def fail_window() -> int:
        """Two verifications with every draft rejected; the plain decodes that follow."""
        for _ in range(2):
            speculator.on_verified("r", 2, 0)
        plain = 0
        while not speculator.wants("r", 1):
            plain += 1
        return plain

    assert speculator.wants("r", 1)
    assert [fail_window() for _ in range(7)] == [4, 8, 16, 32, 64, 128, 128]  # capped
    speculator.on_verified("r", 2, 2)
    speculator.on_verified("r", 2, 1)  # a window at 3/4 >= 0.5 resets the back-off
    assert fail_window() == 4


def test_batch_size_switch() -> None:
    scheduler = make(disable_by_batch_size=1)
    add(scheduler, "a")
    add(scheduler, "b")
    apply(scheduler, scheduler.schedule(), {"a": [3], "b": [3]})
    assert scheduler.schedule().spec_token_ids == {}  # 2 running > 1


def test_nothing_to_copy_also_switches_speculation_off() -> None:
    scheduler = make(k=2, acceptance_window=4)
    speculator = scheduler.speculator
    assert speculator is not None
    add(scheduler, prompt=list(range(10, 20)), max_tokens=20)
    apply(scheduler, scheduler.schedule(), {"r": [50]})
    calls = []
    propose = speculator.proposer.propose
    speculator.proposer.propose = lambda *a: calls.append(1) or propose(*a)  # type: ignore[method-assign]
    for token in range(51, 59):  # new tokens only: the proposer never finds a match
        apply(scheduler, scheduler.schedule(), {"r": [token]})
    # Two empty proposals (2 x k = 4 "drafted"), then 4 plain steps, then 2 more.
    assert len(calls) == 4


def test_a_request_verifying_drafts_when_the_worker_dies_resumes_and_completes() -> None:
    """preempt_all (worker lost) drops the verification in flight with its KV: the
    request recomputes and goes on, instead of waiting forever for that result."""
    scheduler = make()
    request = add(scheduler, max_tokens=6)
    apply(scheduler, scheduler.schedule(), {"r": [3]})
    verifying = scheduler.schedule()
    assert verifying.spec_token_ids == {"r": [1, 2, 3]}
    assert scheduler.preempt_all() == 1  # its result never comes back
    assert request.num_spec_in_flight is None and request.num_computed_tokens == 0
    plan = scheduler.schedule()
    assert plan.scheduled_req_ids == ["r"]
    assert plan.num_scheduled_tokens == [len(PROMPT) + 1]  # prompt + its output, again
    apply(scheduler, plan, {"r": [1]})
    for _ in range(10):
        if "r" not in scheduler.requests:
            break
        plan = scheduler.schedule()
        drafts = plan.spec_token_ids.get("r", [])
        apply(scheduler, plan, {"r": [*drafts, 7]})  # every draft accepted, then a 7
    assert "r" not in scheduler.requests and request.num_output_tokens == 6
    scheduler.kv_cache.check_integrity()

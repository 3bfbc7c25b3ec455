"""Guided decoding in the engine core, with the real tokenizer and xgrammar, driven by a
fake worker that samples from the plan's bitmask.

The worker picks, among the tokens a request's mask row allows, one that depends on
the request's whole history; an unguided request gets a history hash. So an output
that fits its grammar at the end proves each step's mask was the grammar's state after
exactly the request's tokens, through steps in flight, preemption and resumption.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow.config import SchedulerConfig
from kvflow.proto.engine import AddRequest, TokenDelta
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.grammar_compiler import GrammarCompiler, GrammarCompilerConfig
from kvflow.services.scheduler.grammar_matcher import RequestGrammar
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.tokenizer import load_tokenizer

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
REGEX = r"[a-c]{3}-[0-9]{2,4}"


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Any:
    return load_tokenizer(embedded_model_dir)


def compiler_for(tokenizer: Any, **overrides: Any) -> GrammarCompiler:
    config = GrammarCompilerConfig(len(tokenizer), frozenset({tokenizer.eos_token_id}))
    return GrammarCompiler(config, lambda: tokenizer, **overrides)


class MaskWorker:
    """Runs plans in order and samples from each guided row's mask."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.rows_seen: list[list[str]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in plan.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            self.computed[cached.req_id] = cached.num_computed_tokens
        for req_id, forced in plan.forced_token_ids.items():  # jump-forward
            self.tokens[req_id] += forced
        masks = _mask_rows(plan)
        self.rows_seen.append(list(masks))
        req_ids, sampled = [], []
        for req_id, count in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            tokens = self.tokens[req_id]
            self.computed[req_id] += count
            if self.computed[req_id] == len(tokens):
                token = self._pick(tokens, masks.get(req_id))
                tokens.append(token)
                req_ids.append(req_id)
                sampled.append([token])
        return StepResult(step_id=plan.step_id, req_ids=req_ids, sampled_token_ids=sampled)

    def _pick(self, history: list[int], mask: np.ndarray | None) -> int:
        seed = sum(t * (i + 1) for i, t in enumerate(history))
        if mask is None:
            return 300 + seed % 1000  # never EOS: unguided requests run to max_tokens
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        return int(allowed[seed % len(allowed)])


def _mask_rows(plan: StepPlan) -> dict[str, np.ndarray]:
    mask = plan.grammar_bitmask
    if mask is None:
        return {}
    rows = np.frombuffer(mask.data, dtype=np.int32).reshape(len(mask.req_ids), -1)
    return dict(zip(mask.req_ids, rows))


def make_core(tokenizer: Any, depth: int, num_blocks: int, compiler: GrammarCompiler) -> EngineCore:
    vocab = len(tokenizer)
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    eos = frozenset({tokenizer.eos_token_id})
    limits = EngineLimits(vocab, MAX_MODEL_LEN, BLOCK_SIZE, num_blocks, eos)
    features = make_step_features(config, kv_cache, MAX_MODEL_LEN)
    scheduler = Scheduler(config, kv_cache, MAX_MODEL_LEN, vocab, features)
    return EngineCore(scheduler, limits, depth, compiler, grammar_timeout_s=60.0)


def run(core: EngineCore, worker: MaskWorker, max_steps: int = 2000) -> dict[str, list[int]]:
    """Drive the core to the end; returns each request's output tokens."""
    outputs: dict[str, list[int]] = {}
    results: deque[StepResult] = deque()
    deltas: list[TokenDelta] = []
    for _ in range(max_steps):
        deltas += core.poll_grammars(now=0.0)
        while core.can_schedule():
            plan = core.schedule(now=0.0)
            if plan is None:
                break
            results.append(worker.execute(plan))
        if results:
            deltas += core.update(results.popleft(), now=0.0)[1]
        elif core.waiting_for_grammar:
            time.sleep(0.005)  # only compiles under way
        if not core.has_unfinished_requests() and not results:
            break
    for delta in deltas:
        assert delta.finish_reason != "error", delta.error
        outputs.setdefault(delta.req_id, []).extend(delta.new_token_ids)
    return outputs


def add(core: EngineCore, req_id: str, guided: StructuredOutputsParams | None) -> None:
    params = SamplingParams(max_tokens=24, structured_outputs=guided)
    core.add_request(AddRequest(req_id, [1, 7, 9, 11, 13, 17], params, 0.0), now=0.0)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [64, 9])  # 9: guided and plain preempt each other
def test_guided_outputs_fit_their_grammar(tokenizer: Any, depth: int, num_blocks: int) -> None:
    core = make_core(tokenizer, depth, num_blocks, compiler_for(tokenizer))
    worker = MaskWorker(tokenizer.eos_token_id)
    choices = ["alpha", "beta gamma"]
    for i in range(3):
        add(core, f"re{i}", StructuredOutputsParams(regex=REGEX))
        add(core, f"ch{i}", StructuredOutputsParams(choice=choices))
        add(core, f"plain{i}", None)
    outputs = run(core, worker)
    eos = tokenizer.eos_token_id
    for req_id, tokens in outputs.items():
        if req_id.startswith("plain"):
            assert len(tokens) == 24  # ran to max_tokens, unconstrained
            continue
        assert tokens[-1] == eos, req_id  # the grammar ended it
        text = tokenizer.decode(tokens[:-1])
        assert re.fullmatch(REGEX, text) if req_id.startswith("re") else text in choices
    if num_blocks == 9:
        assert core.scheduler.num_preemptions > 0
    # Each finished grammar forced at least its stop token (jump-forward, on by default).
    assert core.scheduler.num_jump_forward_tokens >= 6
    # Only guided requests ever have a mask row.
    assert all(r[:2] in ("re", "ch") for rows in worker.rows_seen for r in rows)


def test_a_compiling_request_waits_while_others_run(tokenizer: Any) -> None:
    release = threading.Event()
    compiler = compiler_for(tokenizer)
    real_compile = compiler._compile

    def slow_compile(params: StructuredOutputsParams) -> Any:
        release.wait(timeout=30)
        return real_compile(params)

    compiler._compile = slow_compile  # type: ignore[method-assign]
    core = make_core(tokenizer, 1, 64, compiler)
    worker = MaskWorker(tokenizer.eos_token_id)
    add(core, "guided", StructuredOutputsParams(regex=REGEX))
    add(core, "plain", None)
    assert core.waiting_for_grammar["guided"].request.status == RequestStatus.WAITING_FOR_GRAMMAR
    for _ in range(5):  # the plain request decodes; the guided one is not planned
        assert core.poll_grammars(now=0.0) == []
        plan = core.schedule(now=0.0)
        assert plan is not None and plan.scheduled_req_ids == ["plain"]
        core.update(worker.execute(plan), now=0.0)
    release.set()
    outputs = run(core, worker)
    assert re.fullmatch(REGEX, tokenizer.decode(outputs["guided"][:-1]))


def test_compile_timeout_fails_only_that_request(tokenizer: Any) -> None:
    release = threading.Event()
    compiler = compiler_for(tokenizer)
    compiler._compile = lambda params: release.wait(30)  # type: ignore[method-assign,assignment,return-value]
    core = make_core(tokenizer, 1, 64, compiler)
    core.grammar_timeout_s = 0.5
    add(core, "guided", StructuredOutputsParams(regex=REGEX))
    assert core.poll_grammars(now=0.1) == []
    (delta,) = core.poll_grammars(now=1.0)
    release.set()
    assert delta.req_id == "guided" and delta.finish_reason == "error"
    assert "grammar_compile_timeout" in (delta.error or "")
    assert compiler.stats.timeouts == 1 and not core.has_unfinished_requests()


def test_a_grammar_no_token_can_begin_fails_that_request_with_its_param(tokenizer: Any) -> None:
    # The choice matches text, but none this tokenizer's tokens can start (a schemathesis
    # find: sampling from the empty mask used to fail it mid-way, a 500).
    core = make_core(tokenizer, 1, 64, compiler_for(tokenizer))
    add(core, "unwritable", StructuredOutputsParams(choice=["\U000ad4d1\u00fb`$\x13"]))
    add(core, "fine", StructuredOutputsParams(choice=["yes", "no"]))
    deadline = time.monotonic() + 60
    deltas: list[Any] = []
    while not deltas and time.monotonic() < deadline:
        deltas = core.poll_grammars(now=0.0)
    (delta,) = [d for d in deltas if d.req_id == "unwritable"]
    assert delta.finish_reason == "error" and delta.error_param == "structured_outputs"
    assert "no token of this model's vocabulary can begin" in (delta.error or "")


class _FailsOnceLookedAt(Future):  # type: ignore[type-arg]
    """A compile that fails just after the loop first asks whether it is done."""

    def done(self) -> bool:
        was_done = super().done()
        if not was_done:
            self.set_exception(ValueError("failed between two looks"))
        return was_done


def test_a_compile_failing_while_polled_fails_only_its_request(tokenizer: Any) -> None:
    # The compile thread may finish between two reads of future.done(); reading it twice
    # once raised the compile's error out of the loop (a CI find).
    core = make_core(tokenizer, 1, 64, compiler_for(tokenizer))
    add(core, "guided", StructuredOutputsParams(regex=REGEX))
    core.waiting_for_grammar["guided"].future = _FailsOnceLookedAt()
    assert core.poll_grammars(now=0.0) == []  # not done when looked at: it waits
    (delta,) = core.poll_grammars(now=0.0)
    assert delta.finish_reason == "error" and "failed between two looks" in (delta.error or "")
    assert not core.has_unfinished_requests()


def test_abort_while_compiling(tokenizer: Any) -> None:
    core = make_core(tokenizer, 1, 64, compiler_for(tokenizer))
    add(core, "guided", StructuredOutputsParams(regex=REGEX))
    (delta,) = core.abort_requests(["guided"])
    assert delta.finish_reason == "abort" and not core.has_unfinished_requests()


def test_compile_cache_is_keyed_by_canonical_text(tokenizer: Any) -> None:
    compiler = compiler_for(tokenizer)
    compiler.config = GrammarCompilerConfig(len(tokenizer), frozenset({2}), cache_size=1)
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    first = compiler.submit(StructuredOutputsParams(json=schema)).result(timeout=60)
    compiler.collect()
    again = compiler.submit(StructuredOutputsParams(json=schema.replace(" ", ""))).result()
    assert again is first and compiler.stats.cache_hits == 1
    compiler.submit(StructuredOutputsParams(regex="x+")).result(timeout=60)
    compiler.collect()  # cache_size 1: the schema is evicted
    compiler.submit(StructuredOutputsParams(json=schema)).result(timeout=60)
    assert compiler.stats.cache_misses == 3 and len(compiler.stats.compile_seconds) == 3


def test_matcher_rollback_and_replay(tokenizer: Any) -> None:
    compiled = compiler_for(tokenizer).submit(StructuredOutputsParams(regex="ab-[0-9]+"))
    grammar = RequestGrammar(compiled.result(timeout=60))
    ids = tokenizer.encode("ab-12", add_special_tokens=False)
    assert all(grammar.accept(t) for t in ids)
    assert not grammar.accept(tokenizer.encode("zz", add_special_tokens=False)[0])
    grammar.rollback(len(ids))
    assert grammar.num_accepted == 0
    assert grammar.replay(ids) and grammar.num_accepted == len(ids)
    assert grammar.accept(tokenizer.eos_token_id) and grammar.is_terminated


def test_forced_token_only_where_one_token_is_allowed(tokenizer: Any) -> None:
    compiled = compiler_for(tokenizer).submit(StructuredOutputsParams(choice=["alpha"]))
    grammar = RequestGrammar(compiled.result(timeout=60))
    forced = []
    while (token := grammar.forced_token()) is not None:
        assert grammar.accept(token)
        forced.append(token)
    # "alpha" may be spelled several ways ("al"+"pha", "alpha"...): nothing forced yet.
    assert forced == [] and not grammar.is_terminated
    assert all(grammar.accept(t) for t in tokenizer.encode("alpha", add_special_tokens=False))
    assert grammar.forced_token() == tokenizer.eos_token_id  # only the stop token is left
    row, restricts = grammar.next_row()
    assert restricts and np.count_nonzero(row) == 1
    assert grammar.accept(tokenizer.eos_token_id) and grammar.forced_token() is None


@pytest.mark.parametrize(
    ("overrides", "jumps"),
    [({}, True), ({"logprobs": 2}, False), ({"min_tokens": 5}, False)],
)
def test_jump_forward_skips_logprobs_and_owed_min_tokens(
    tokenizer: Any, overrides: dict[str, Any], jumps: bool
) -> None:
    from kvflow.services.scheduler.jump_forward import jump_forward
    from kvflow.services.scheduler.request import Request

    constraint = StructuredOutputsParams(choice=["alpha"])
    params = SamplingParams(max_tokens=8, structured_outputs=constraint, **overrides)
    eos = frozenset({tokenizer.eos_token_id})
    request = Request("r", [1, 2], params, eos_token_ids=eos, max_tokens=8)
    request.grammar = RequestGrammar(compiler_for(tokenizer).submit(constraint).result(60))
    for token in tokenizer.encode("alpha", add_special_tokens=False):
        assert request.grammar.accept(token)
        request.append_output_token(token)
    forced = jump_forward(request, MAX_MODEL_LEN)
    assert forced == ([tokenizer.eos_token_id] if jumps else [])
    assert request.is_finished == jumps


def test_batched_fill_equals_one_row_at_a_time(tokenizer: Any) -> None:
    """`fill_rows` (xgrammar's batched filler into a shared buffer) gives each grammar
    the row and the restricts flag that filling it alone gives, in every state: after
    each prefix of the regex's output, none included."""
    from kvflow.services.scheduler.grammar_matcher import fill_rows

    compiler = compiler_for(tokenizer)
    regex = compiler.submit(StructuredOutputsParams(regex=REGEX)).result(timeout=60)
    text = tokenizer.encode("abc-1234", add_special_tokens=False)
    batched, alone = [], []
    for prefix in range(len(text) + 1):
        for group in (batched, alone):
            grammar = RequestGrammar(regex)
            assert all(grammar.accept(t) for t in text[:prefix])
            group.append(grammar)
    fill_rows(batched)
    assert not any(g.row_is_stale for g in batched)
    for mine, theirs in zip(batched, alone, strict=True):
        row, restricts = mine.next_row()  # not filled again: the batched row
        want_row, want_restricts = theirs.next_row()
        assert np.array_equal(row, want_row) and restricts == want_restricts
    assert all(restricts for _, restricts in (g.next_row() for g in batched))
    batched[0].accept(text[0])  # moved: stale again, refilled alone on demand
    assert batched[0].row_is_stale and np.array_equal(
        batched[0].next_row()[0], alone[1].next_row()[0]
    )


def test_batched_fill_finds_the_same_forced_tokens(tokenizer: Any) -> None:
    """Jump-forward's probe on batch-filled rows (which skips rows with more than one
    nonzero word) forces what it forces on rows filled one at a time."""
    from kvflow.services.scheduler.grammar_matcher import fill_rows

    choice = compiler_for(tokenizer).submit(StructuredOutputsParams(choice=["alpha", "beta"]))
    compiled = choice.result(timeout=60)
    text = tokenizer.encode("alpha", add_special_tokens=False)
    batched, alone = [], []
    for prefix in range(len(text) + 1):
        for group in (batched, alone):
            grammar = RequestGrammar(compiled)
            assert all(grammar.accept(t) for t in text[:prefix])
            group.append(grammar)
    fill_rows(batched)
    forced = [g.forced_token() for g in batched]
    assert forced == [g.forced_token() for g in alone]
    assert forced[-1] == tokenizer.eos_token_id  # after "alpha" only the stop token

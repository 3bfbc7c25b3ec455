"""Speculative decoding end to end, offline: greedy outputs are token-identical with and
without speculation (n-gram and suffix proposers) whatever the batching does (batch 1,
mixed batches, n > 1, chunked prefill, preemption, async scheduling); stop tokens, stop
strings and max_tokens landing inside an accepted run cut exactly where decoding without
speculation cuts; and 1,000 requests with random rejections and aborts leak no KV block.
Every case also checks that drafts were accepted, so an inert speculator cannot pass."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 4.0}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat",
    CODE + "\ndef mul(a, b):\n",
    "Once upon a time, in a land far away, there lived a dragon who",
]


def greedy(max_tokens: int = 24, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def make_llm(model_dir: Path, spec: dict[str, Any] | None, **options: Any) -> LLM:
    options.setdefault("num_blocks", 256)
    return LLM(str(model_dir), dtype="float32", speculative_config=spec, **options)


def run(
    llm: LLM, prompts: list[str], params: SamplingParams, one_by_one: bool = False
) -> list[list[int]]:
    if one_by_one:
        return [llm.generate([p], params)[0].token_ids for p in prompts]
    outs = llm.generate(prompts, params)
    return [c.token_ids for o in outs for c in o.outputs]


def accepted(llm: LLM) -> int:
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    return speculator.counters.num_accepted_tokens


def assert_no_blocks_held(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check_integrity()
    assert kv.usage == 0.0, "a finished request still holds KV blocks"


# The embedded model copies from repetitive prompts, so drafts get accepted (a tiny
# random-weight model almost never agrees with a draft).
@pytest.fixture(scope="module")
def model(embedded_model_dir: Path) -> Path:
    return embedded_model_dir


@pytest.fixture(scope="module")
def baseline(model: Path) -> list[list[int]]:
    return run(make_llm(model, None), PROMPTS, greedy())


CASES = {
    "mixed batch": ({}, False),
    "batch 1": ({}, True),
    "chunked prefill": ({"max_num_batched_tokens": 8}, False),
    "preemption": ({"num_blocks": 20, "block_size": 4}, False),
    "async scheduling": ({"async_scheduling": True}, False),
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_is_token_identical(
    model: Path, baseline: list[list[int]], method: str, case: str
) -> None:
    options, one_by_one = CASES[case]
    llm = make_llm(model, METHODS[method], **options)
    assert run(llm, PROMPTS, greedy(), one_by_one) == baseline
    assert accepted(llm) >= 10
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if case == "batch 1":  # verification steps replay the CPU decode graphs
        assert llm.engine.runner.decode_graphs.num_verify_replays > 0
    assert_no_blocks_held(llm)


def test_n_greater_than_one_and_opt_out(model: Path, baseline: list[list[int]]) -> None:
    llm = make_llm(model, NGRAM)
    outs = run(llm, PROMPTS[:2], greedy(n=2))
    assert outs == [baseline[0]] * 2 + [baseline[1]] * 2
    before = accepted(llm)
    assert run(llm, PROMPTS, greedy(speculative=False)) == baseline
    assert accepted(llm) == before  # opted out: nothing drafted
    assert_no_blocks_held(llm)


def test_stops_inside_accepted_runs_cut_exactly(model: Path) -> None:
    """Stop tokens, stop strings and max_tokens at every position of the output: the
    tokens, text, finish reason and stop reason equal decoding without speculation."""
    plain, spec = make_llm(model, None), make_llm(model, NGRAM)
    prompt = PROMPTS[1]
    full = plain.generate([prompt], greedy(max_tokens=24))[0].outputs[0]
    variants = [greedy(max_tokens=m) for m in range(1, 13)]
    variants += [greedy(stop_token_ids=[t]) for t in full.token_ids[2:14:3]]
    text = full.text
    variants += [greedy(stop=[text[i : i + 3]]) for i in range(2, min(len(text) - 3, 40), 5)]
    variants += [greedy(stop=[text[5:8]], include_stop_str_in_output=True)]
    for params in variants:
        want = plain.generate([prompt], params)[0].outputs[0]
        got = spec.generate([prompt], params)[0].outputs[0]
        key = (params.max_tokens, params.stop_token_ids, params.stop)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        ), key
    assert accepted(spec) > 0
    assert_no_blocks_held(spec)


def test_thousand_requests_with_rejections_and_aborts_leak_nothing(model: Path) -> None:
    rng = random.Random(0)
    llm = make_llm(model, {**NGRAM, "num_speculative_tokens": 3}, num_blocks=64, block_size=4)
    engine = llm.engine
    vocab = engine.vocab_size
    live: list[str] = []
    for i in range(1000):
        base = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        prompt = (base * 8)[: rng.randrange(4, 30)]  # repetitive: drafts get proposed
        temperature = rng.choice([0.0, 0.8, 1.5])  # and accepted or rejected at random
        params = SamplingParams(
            max_tokens=rng.randrange(1, 12), temperature=temperature, seed=rng.choice([None, i])
        )
        engine.add_request(f"r{i}", prompt, params)
        live.append(f"r{i}")
        if rng.random() < 0.3:
            for output in engine.step():
                if output.finished:
                    live.remove(output.request_id)
        if rng.random() < 0.1 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if i % 100 == 0:
            engine.kv_cache.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    counters = engine.scheduler.speculator.counters  # type: ignore[union-attr]
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # some rejected
    assert_no_blocks_held(llm)


def test_logprobs_of_accepted_tokens_equal_plain_decoding(model: Path) -> None:
    params = greedy(max_tokens=16, logprobs=2)
    plain = make_llm(model, None).generate(PROMPTS[:2], params)
    spec_llm = make_llm(model, NGRAM)
    spec = spec_llm.generate(PROMPTS[:2], params)
    assert accepted(spec_llm) > 0
    for want, got in zip(plain, spec):
        assert got.token_ids == want.token_ids
        assert want.logprobs is not None and got.logprobs is not None
        assert len(got.logprobs) == len(got.token_ids)
        for w, g in zip(want.logprobs, got.logprobs):
            assert w.keys() == g.keys()
            for token_id, logprob in w.items():
                assert g[token_id].rank == logprob.rank
                assert g[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)


def test_guided_requests_beside_speculating_ones(model: Path, baseline: list[list[int]]) -> None:
    """A guided request in a speculating batch keeps to its grammar (it decodes without
    drafts), and the plain requests beside it still speculate and keep their tokens."""
    from kvflow.sampling_params import StructuredOutputsParams

    llm = make_llm(model, NGRAM)
    digits = greedy(
        max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    )
    guided, *plain = llm.generate([PROMPTS[1], *PROMPTS], [digits] + [greedy()] * len(PROMPTS))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", guided.outputs[0].text), guided.outputs[0].text
    assert [o.outputs[0].token_ids for o in plain] == baseline
    assert accepted(llm) > 0
    assert_no_blocks_held(llm)

"""The draft_model method end to end, offline, on tiny random-weight models: the target
as its own draft accepts (almost) every draft, a different tiny model almost none, and
either way greedy outputs are token-identical to decoding without speculation, whatever
the batching does (batch 1, mixed batch, n > 1, chunked prefill, preemption, async
scheduling, stops and max_tokens inside a run). Under temperature 1 the self-draft
still accepts ~all drafts: that only holds if q is the draft's real distribution
(a one-hot q would accept a draft with probability p(d) alone)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.errors import ConfigError

PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a land far away, there lived a dragon who",
    "def add(a, b):\n",
    "The capital of France is",
]

CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "mixed batch": ({}, False),
    "batch 1": ({}, True),
    "chunked prefill": ({"max_num_batched_tokens": 8}, False),
    "preemption": ({"num_blocks": 24, "block_size": 4}, False),
    "async scheduling": ({"async_scheduling": True}, False),
}


def greedy(max_tokens: int = 20, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def spec(draft: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft)}


def make_llm(target: Path, draft: Path | None, **options: Any) -> LLM:
    options.setdefault("num_blocks", 128)
    config = None if draft is None else spec(draft)
    return LLM(str(target), dtype="float32", num_threads=1, speculative_config=config, **options)


def run(llm: LLM, params: SamplingParams, one_by_one: bool = False) -> list[list[int]]:
    if one_by_one:
        return [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    return [c.token_ids for o in llm.generate(PROMPTS, params) for c in o.outputs]


def rates(llm: LLM) -> tuple[int, int]:
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    return speculator.counters.num_accepted_tokens, speculator.counters.num_draft_tokens


def assert_no_blocks_held(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check_integrity()
    assert kv.usage == 0.0, "a finished request still holds KV blocks"


@pytest.fixture(scope="module")
def models(tiny_model_dir: Callable[[str], Path]) -> tuple[Path, Path]:
    """(target, a different model with the same tokenizer)."""
    return tiny_model_dir("llama"), tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def baseline(models: tuple[Path, Path]) -> list[list[int]]:
    return run(make_llm(models[0], None), greedy())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_self_draft_accepts_all_and_keeps_greedy_tokens(
    models: tuple[Path, Path], baseline: list[list[int]], case: str
) -> None:
    options, one_by_one = CASES[case]
    target = models[0]
    llm = make_llm(target, target, **options)
    assert run(llm, greedy(), one_by_one) == baseline
    accepted, drafted = rates(llm)
    assert drafted >= 20 and accepted >= 0.95 * drafted, (accepted, drafted)
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_blocks_held(llm)


def test_different_draft_keeps_greedy_tokens(
    models: tuple[Path, Path], baseline: list[list[int]]
) -> None:
    target, other = models
    llm = make_llm(target, other)
    assert run(llm, greedy()) == baseline
    accepted, drafted = rates(llm)
    assert drafted >= 20 and accepted < 0.5 * drafted, (accepted, drafted)
    # Opted-out requests beside speculating ones: a mixed verification batch.
    params = [greedy(speculative=i % 2 == 0) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert rates(llm)[1] > drafted
    assert_no_blocks_held(llm)


def test_n_seeds_stops_and_max_tokens(models: tuple[Path, Path]) -> None:
    """n > 1, a seeded random request (reproducible), and stops and max_tokens at every
    position of a run: tokens, text, finish and stop reasons as without speculation."""
    target, _ = models
    plain, spec_llm = make_llm(target, None), make_llm(target, target)
    prompt = PROMPTS[1]
    full = plain.generate([prompt], greedy(max_tokens=16))[0].outputs[0]
    variants = [greedy(n=2), *[greedy(max_tokens=m) for m in range(1, 8)]]
    variants += [greedy(stop_token_ids=[t]) for t in full.token_ids[2:12:3]]
    text = full.text
    variants += [greedy(stop=[text[i : i + 3]]) for i in range(2, min(len(text) - 3, 30), 7)]
    for params in variants:
        want = plain.generate([prompt], params)[0].outputs
        got = spec_llm.generate([prompt], params)[0].outputs
        key = (params.n, params.max_tokens, params.stop_token_ids, params.stop)
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == [
            (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in want
        ], key
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = spec_llm.generate([prompt], seeded)[0].outputs[0].token_ids
    assert spec_llm.generate([prompt], seeded)[0].outputs[0].token_ids == first
    assert len(first) == 12
    assert_no_blocks_held(spec_llm)


def test_random_sampling_uses_the_drafts_distribution(models: tuple[Path, Path]) -> None:
    """Temperature 1, top-p 0.9: p == q for a self-draft, so min(1, p/q) accepts every
    draft; with a one-hot q only p(d) of them would be accepted."""
    target, _ = models
    llm = make_llm(target, target)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, ignore_eos=True, n=2)
    outs = llm.generate(PROMPTS, params)
    assert all(len(c.token_ids) == 24 for o in outs for c in o.outputs)
    accepted, drafted = rates(llm)
    assert drafted >= 40 and accepted >= 0.95 * drafted, (accepted, drafted)
    assert_no_blocks_held(llm)


def test_draft_with_another_vocabulary_is_refused(
    models: tuple[Path, Path], embedded_model_dir: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    other = tmp_path / "other-vocab"
    shutil.copytree(models[1], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="tokenizer"):
        make_llm(models[0], other)

"""Sampling parameters through the offline engine (scheduler, worker, sampler), checked
against an independent reference: transformers' float32 logits with transformers' logits
processors, and OpenAI's presence/frequency penalties (tests/sampling_reference.py).

Distributions are compared by chi-square tests on thousands of seeded samples, so every
run draws the same tokens. Each test also checks its own power: the same samples must
reject the distribution a plausible bug would give (top-k off by one, a penalty with the
wrong sign or over the wrong history...), so a pass means something.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sampling_reference import (
    Processing,
    Reference,
    Spread,
    distribution_cases,
    penalty_cases,
    penalty_prompt,
    pick_spread,
    sampling_fields,
    tally_conditionals,
    token_fit,
)

from kvflow import LLM, SamplingParams

# The prompt whose next token is spread over the most tokens at this temperature is used.
PROMPT_CANDIDATES = [
    "The capital of France is",
    "Once upon a time",
    "In 1999,",
    "Dear Sir,",
    "My name is",
    "Yesterday I went to",
    "The quick brown fox",
    "What is the",
]
TEMPERATURE = 0.25
NUM_SAMPLES = 2000


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Any) -> Path:
    return Path(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def samples(out: Any) -> list[list[int]]:
    """The token ids of each of a request's n samples."""
    return [completion.token_ids for completion in out.outputs]


def firsts(outs: list[Any]) -> list[list[int]]:
    """The token ids of each request's first sample."""
    return [out.outputs[0].token_ids for out in outs]


# ---- seeds ---------------------------------------------------------------------------

SEEDED = [
    # top_p only: alone it samples 64 candidates then falls back to the whole vocabulary;
    # beside the top_k=300 row below it samples 300 candidates. Same tokens either way.
    SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True),
    SamplingParams(
        temperature=0.6, min_p=0.02, presence_penalty=0.5, seed=99, max_tokens=9, ignore_eos=True
    ),
]
OTHERS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),  # unseeded
    SamplingParams(
        temperature=1.2, top_k=300, frequency_penalty=1.0, seed=7, max_tokens=15, ignore_eos=True
    ),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, logprobs=3, max_tokens=3),
]


def seeded_prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(t) for t in ("Once upon a time", "Dear Sir, I write to")]


def test_seeded_tokens_reproduce_whatever_else_is_batched(llm: LLM) -> None:
    prompts = seeded_prompts(llm)
    alone = [firsts(llm.generate([p], s))[0] for p, s in zip(prompts, SEEDED)]
    again = [firsts(llm.generate([p], s))[0] for p, s in zip(prompts, SEEDED)]
    assert again == alone

    long_prompt = llm.tokenizer.encode("A much longer prompt, " * 8)
    other_prompts = [long_prompt, prompts[1], prompts[0][:2], long_prompt[:7]]
    batch = [other_prompts[0], prompts[0], other_prompts[1], other_prompts[2], prompts[1]]
    params = [OTHERS[0], SEEDED[0], OTHERS[1], OTHERS[2], SEEDED[1]]
    outs = firsts(llm.generate(batch, params))
    assert [outs[1], outs[4]] == alone

    # Reversed order, another mix, and the seeded rows at other batch positions.
    batch = [prompts[1], other_prompts[3], prompts[0], other_prompts[0]]
    outs = firsts(llm.generate(batch, [SEEDED[1], OTHERS[3], SEEDED[0], OTHERS[2]]))
    assert [outs[2], outs[0]] == alone


def test_seeded_tokens_survive_chunked_prefill_and_preemption(llm: LLM, model_dir: Path) -> None:
    """A seeded request that is preempted and recomputed resumes its random stream where
    it left off (it used to restart it, repeating its first draws)."""
    prompts = seeded_prompts(llm) * 2
    params = SEEDED * 2
    alone = [firsts(llm.generate([p], s))[0] for p, s in zip(prompts, params)]
    tight = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        num_blocks=10,
        block_size=4,
        max_num_batched_tokens=8,
    )
    assert firsts(tight.generate(prompts, params)) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    batch = tight.engine.runner.batch
    assert batch.sampling.penalties.counts is not None  # SEEDED[1] has a presence penalty
    # The worker forgets finished requests when the next plan says so, and reuses slots.
    tight.generate(prompts[:1], params[:1])
    assert list(batch.slot_of.values()) == [0]


def test_no_penalty_state_without_penalised_requests(model_dir: Path) -> None:
    fresh = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=4)
    params = [OTHERS[0], OTHERS[1], SEEDED[0]]
    fresh.generate(seeded_prompts(fresh) * 3, params * 2)
    batch = fresh.engine.runner.batch
    assert batch.sampling.penalties.counts is None
    fresh.generate(seeded_prompts(fresh)[:1], [OTHERS[3]])  # repetition_penalty: made now
    assert batch.sampling.penalties.counts is not None


def test_n_samples_differ_and_reproduce(llm: LLM) -> None:
    prompt = seeded_prompts(llm)[0]
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    tokens = samples(first)
    assert len({tuple(t) for t in tokens}) == 3, tokens
    assert samples(llm.generate([prompt], params)[0]) == tokens

    unseeded = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True)
    tokens = samples(llm.generate([prompt], unseeded)[0])
    assert len({tuple(t) for t in tokens}) == 3, tokens


# ---- next-token distributions --------------------------------------------------------


@pytest.fixture(scope="module")
def spread(llm: LLM, reference: Reference) -> Spread:
    prompts = [llm.tokenizer.encode(text) for text in PROMPT_CANDIDATES]
    return pick_spread(reference, prompts, TEMPERATURE)


def sampling_params(spec: Processing, **kwargs: Any) -> SamplingParams:
    return SamplingParams(**sampling_fields(spec), ignore_eos=True, **kwargs)


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "min_p", "logit_bias"])
def test_next_token_distribution_matches_transformers(llm: LLM, spread: Spread, case: str) -> None:
    spec, bugs = distribution_cases(spread, TEMPERATURE)[case]
    params = sampling_params(spec, n=NUM_SAMPLES, seed=1, max_tokens=1)
    tokens = [t[0] for t in samples(llm.generate([spread.prompt], params)[0])]

    def fit(s: Processing) -> Any:
        return token_fit(spread.next_probs(s), tokens)

    assert not fit(spec).rejected, f"{case}: {fit(spec)}"
    for bug in bugs:
        assert fit(bug).rejected, f"the test cannot tell {spec} from {bug}: {fit(bug)}"


# ---- penalties over a real history ---------------------------------------------------

PENALTY_SAMPLES = 96
PENALTY_STEPS = 8


@pytest.mark.slow
@pytest.mark.parametrize("case", ["presence", "frequency", "repetition"])
def test_penalties_match_transformers_over_the_real_history(
    llm: LLM, reference: Reference, case: str
) -> None:
    """Every step of every sample is compared with transformers' distribution given that
    sample's own history (teacher-forced), so the worker's token history is checked too.
    The engine's logprobs are raw (vLLM's default), so they check the history alignment,
    not the penalty: the penalty shows in which tokens are sampled."""
    spec, bugs = penalty_cases()[case]
    prompt = penalty_prompt(llm.tokenizer)
    params = sampling_params(spec, n=PENALTY_SAMPLES, seed=2, max_tokens=PENALTY_STEPS, logprobs=0)
    out = llm.generate([prompt], params)[0]
    outputs = samples(out)
    tallies, raw = tally_conditionals(reference, prompt, outputs, {"spec": spec, **bugs})

    engine_raw = torch.tensor(
        [[lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)] for c in out.outputs]
    )
    torch.testing.assert_close(engine_raw, raw, atol=1e-4, rtol=0)
    fit = tallies["spec"].fit()
    assert not fit.rejected, f"{case}: {fit}"
    for name in bugs:
        bug_fit = tallies[name].fit()
        assert bug_fit.rejected, f"the test cannot tell {case} {name}: {bug_fit}"


# ---- stopping ------------------------------------------------------------------------


def test_min_tokens_holds_back_eos_then_eos_stops(llm: LLM) -> None:
    (eos,) = llm.engine.eos_token_ids
    prompt = seeded_prompts(llm)[0]
    likely_eos: dict[str, Any] = {"logit_bias": {eos: 100.0}, "max_tokens": 20, "seed": 3}
    out = llm.generate([prompt], SamplingParams(n=4, min_tokens=5, **likely_eos))[0]
    for c in out.outputs:
        assert len(c.token_ids) == 6 and c.token_ids[5] == eos, c.token_ids
        assert eos not in c.token_ids[:5]
        assert (c.finish_reason, c.stop_reason) == ("stop", None)

    out = llm.generate([prompt], SamplingParams(**likely_eos))[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([eos], "", "stop")

    # Without skipping special tokens, the EOS that stopped the request is still not text.
    keep_special = SamplingParams(min_tokens=2, skip_special_tokens=False, **likely_eos)
    out = llm.generate([prompt], keep_special)[0]
    assert len(out.token_ids) == 3 and llm.tokenizer.decode([eos]) not in out.text, out.text

    out = llm.generate([prompt], SamplingParams(ignore_eos=True, **likely_eos))[0]
    assert (out.token_ids, out.finish_reason) == ([eos] * 20, "length")


def test_stop_token_ids_stop_and_their_text_is_left_out(llm: LLM) -> None:
    """vLLM's rule: the stop token id ends the output's token ids; its text is included
    only with include_stop_str_in_output."""
    prompt = seeded_prompts(llm)[0]
    stop = llm.tokenizer.encode(" Hello")[-1]
    likely_stop: dict[str, Any] = {"logit_bias": {stop: 100.0}, "stop_token_ids": [stop], "seed": 4}
    out = llm.generate([prompt], SamplingParams(min_tokens=2, **likely_stop))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[2] == stop and stop not in out.token_ids[:2]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)

    params = SamplingParams(min_tokens=2, include_stop_str_in_output=True, **likely_stop)
    with_stop = llm.generate([prompt], params)[0].outputs[0]
    assert with_stop.token_ids == out.token_ids
    assert with_stop.text == out.text + " Hello", (with_stop.text, out.text)

    out = llm.generate([prompt], SamplingParams(**likely_stop))[0].outputs[0]
    assert (out.token_ids, out.text, out.stop_reason) == ([stop], "", stop)

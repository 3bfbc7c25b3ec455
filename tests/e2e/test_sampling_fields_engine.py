"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens through the offline
engine (scheduler, worker, sampler) on a tiny random-weight model: each field changes
the output exactly as specified, and the same request without it does not comply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import with_bad_words_token_ids

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(str(Path(tiny_model_dir("llama"))), dtype="float32", device="cpu")


def tokens(llm: LLM, prompt: str | list[int], **fields: Any) -> list[int]:
    params = SamplingParams(max_tokens=12, ignore_eos=True, **fields)
    return list(llm.generate([prompt], params)[0].outputs[0].token_ids)


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_allowed_token_ids_are_the_only_ones_sampled(llm: LLM) -> None:
    allowed = [11, 500, 1234, 4321]
    for fields in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        free = tokens(llm, PROMPT, **fields)
        assert not set(free) <= set(allowed)
        out = tokens(llm, PROMPT, allowed_token_ids=allowed, **fields)
        assert len(out) == 12 and set(out) <= set(allowed), out
    # Combined with logit_bias, the bias still picks among the allowed tokens.
    out = tokens(llm, PROMPT, temperature=0.0, allowed_token_ids=allowed,
                 logit_bias={500: 100.0})  # fmt: skip
    assert out == [500] * 12


def test_bad_words_never_complete_and_a_word_may_still_begin(llm: LLM) -> None:
    free = tokens(llm, PROMPT, temperature=0.0)
    # A two-token word the greedy output writes (one that reads back as those tokens).
    word, at = None, -1
    for i in range(1, len(free) - 1):
        text = llm.tokenizer.decode(free[i : i + 2])
        ids = with_bad_words_token_ids(SamplingParams(bad_words=[text]), llm.tokenizer)
        if free[i : i + 2] in (ids.bad_words_token_ids or []):
            word, at = text, i
            break
    assert word is not None, "no round-tripping two-token word in the greedy output"
    banned = with_bad_words_token_ids(SamplingParams(bad_words=[word]), llm.tokenizer)
    sequences = banned.bad_words_token_ids or []
    out = tokens(llm, PROMPT, temperature=0.0, bad_words=[word])
    assert out != free and not any(contains(out, s) for s in sequences), (word, out)
    if all(len(s) == 2 for s in sequences):  # only the second token is ever banned
        assert out[: at + 1] == free[: at + 1] and out[at + 1] != free[at + 1]


def test_single_token_bad_word_is_banned_everywhere(llm: LLM) -> None:
    free = tokens(llm, PROMPT, temperature=1.0, seed=9)
    word = llm.tokenizer.decode([free[0]])
    banned = with_bad_words_token_ids(SamplingParams(bad_words=[word]), llm.tokenizer)
    singles = {s[0] for s in banned.bad_words_token_ids or [] if len(s) == 1}
    assert free[0] in singles, (word, banned.bad_words_token_ids)
    out = tokens(llm, PROMPT, temperature=1.0, seed=9, bad_words=[word])
    assert not singles & set(out), out


def test_truncate_prompt_tokens_keeps_the_last_k(llm: LLM) -> None:
    ids = list(llm.tokenizer.encode(PROMPT))
    params = SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=4)
    out = llm.generate([PROMPT], params)[0]
    assert out.prompt_token_ids == ids[-4:]
    short = llm.generate([ids[-4:]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.outputs[0].token_ids == short.outputs[0].token_ids
    whole = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert whole.prompt_token_ids == ids

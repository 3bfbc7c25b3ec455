"""Guided decoding through the offline `LLM` (the same engine core the server runs):
the embedded SmolLM2 at temperature 1.0 and a tiny random-weight model, whose
arbitrary preferences only the grammar keeps in check."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 16},
        "population": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])"
GRAMMAR = """root ::= sum
sum ::= term (" + " term)*
term ::= [1-9] [0-9]? | "(" sum ")"
"""


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(dtype="float32", num_blocks=256, async_scheduling=True)


def guided(max_tokens: int = 120, **constraint: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=11,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def test_json_schema_outputs_validate(smol: LLM) -> None:
    conversation = [{"role": "user", "content": "Tell me about a city, as JSON."}]
    params = guided(json=SCHEMA)
    params.n = 4
    (output,) = smol.chat(conversation, params)
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample
        jsonschema.validate(json.loads(sample.text), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(smol: LLM) -> None:
    prompts = ["A year and month:", "Pick one:", "An arithmetic sum:"]
    params = [
        guided(regex=REGEX),
        guided(choice=["north", "south", "east by west"]),
        guided(max_tokens=60, grammar=GRAMMAR),
    ]
    year, choice, arithmetic = smol.generate(prompts, params)
    assert re.fullmatch(REGEX, year.text)
    assert choice.text in ("north", "south", "east by west")
    if arithmetic.outputs[0].finish_reason == "stop":  # a long sum may hit max_tokens
        assert re.fullmatch(r"[0-9()+ ]+", arithmetic.text)
        assert eval(arithmetic.text) > 0


def test_logprobs_are_those_of_the_masked_distribution(smol: LLM) -> None:
    params = guided(max_tokens=4, choice=["yes", "no"])
    params.logprobs = 5
    params.temperature = 0.0
    (output,) = smol.generate(["Is water wet? Answer:"], params)
    first = output.outputs[0].logprobs[0]  # type: ignore[index]
    finite = {t: lp.logprob for t, lp in first.items() if math.isfinite(lp.logprob)}
    for token_id in finite:  # only tokens that start "yes" or "no" have any mass
        piece = smol.tokenizer.decode([token_id])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    assert 0.9 < sum(math.exp(v) for v in finite.values()) <= 1.0 + 1e-4


def test_bad_grammar_is_refused_before_the_engine(smol: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smol.generate(["x"], guided(grammar="root ::= ("))
    assert info.value.param == "structured_outputs.grammar"
    assert not smol.engine.has_unfinished_requests()


def test_random_model_stays_inside_the_grammar(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_blocks=64)
    prompts = [f"prompt {i}" for i in range(6)]
    outputs = llm.generate(prompts, guided(max_tokens=16, regex=REGEX))
    for output in outputs:
        assert re.fullmatch(REGEX, output.text), output.text
        assert output.outputs[0].finish_reason == "stop"


def test_guided_batch_matches_guided_alone(tiny_model_dir: Any) -> None:
    """Greedy tokens do not depend on the batch: each row gets its own mask (or none)."""
    llm = LLM(str(Path(tiny_model_dir("llama"))), dtype="float32", num_blocks=64)
    year = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=_regex())
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    pick = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=_choice())
    mixed = llm.generate(["abc", "plain one", "def"], [year, plain, pick])
    assert mixed[0].token_ids == llm.generate(["abc"], year)[0].token_ids
    assert mixed[1].token_ids == llm.generate(["plain one"], plain)[0].token_ids
    assert mixed[2].text in ("a", "b")
    assert re.fullmatch(REGEX, mixed[0].text)


def _regex() -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=REGEX)


def _choice() -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=["a", "b"])

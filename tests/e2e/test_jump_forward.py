"""Jump-forward (grammar-forced tokens appended without a model step): greedy outputs
are token for token those without it, on JSON schemas, regexes and choices, and it
takes fewer steps. The embedded SmolLM2 (a real tokenizer with multi-character tokens,
where forced spans are common) with and without steps in flight."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).parent.parent / "data" / "json_schema_corpus.json"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"const": "person"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["administrator", "engineer"]},
    },
    "required": ["name", "kind", "age", "role"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "object", "properties": {"id": {"type": "integer"}}},
            "minItems": 1,
            "maxItems": 2,
        },
        "done": {"type": "boolean"},
    },
    "required": ["items", "done"],
}
CONSTRAINTS: list[dict[str, Any]] = [
    {"json": PERSON},
    {"json": PERSON, "disable_any_whitespace": True},
    {"json": ITEMS},
    {"regex": r"ID-(alpha|beta)-[0-9]{3}\.done"},
    {"choice": ["supercalifragilistic", "no"]},
]
PROMPTS = [
    "Describe a person as JSON.",
    "A compact JSON person:",
    "A list of items as JSON:",
    "An identifier:",
    "Say a long word:",
]


def _params(constraint: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_tokens=64,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


class Run:
    """One engine's greedy outputs on the batch, and its steps for one request alone."""

    def __init__(self, jump_forward: bool, async_scheduling: bool) -> None:
        llm = LLM(
            dtype="float32",
            num_blocks=128,
            num_threads=1,
            async_scheduling=async_scheduling,
            grammar_jump_forward=jump_forward,
        )
        outputs = llm.generate(PROMPTS, [_params(c) for c in CONSTRAINTS])
        self.tokens = [list(o.outputs[0].token_ids) for o in outputs]
        core = llm.engine.core
        self.jumped = core.scheduler.num_jump_forward_tokens
        before = core.counters.num_steps
        (alone,) = llm.generate(PROMPTS[:1], _params(CONSTRAINTS[0]))
        assert alone.outputs[0].token_ids == self.tokens[0]
        self.steps_alone = core.counters.num_steps - before
        self.num_tokens_alone = len(alone.outputs[0].token_ids)


@pytest.fixture(scope="module")
def without() -> Run:
    return Run(jump_forward=False, async_scheduling=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_outputs_identical_and_fewer_steps(without: Run, async_scheduling: bool) -> None:
    run = Run(jump_forward=True, async_scheduling=async_scheduling)
    assert without.jumped == 0
    for expected, got in zip(without.tokens, run.tokens):
        assert got == expected
    assert run.jumped > len(PROMPTS)  # at least each one's final stop token, and more
    # Without it, one step per output token (the prompt's step samples the first).
    assert without.steps_alone == without.num_tokens_alone
    if not async_scheduling:  # steps in flight count differently: compare like with like
        assert run.steps_alone < without.steps_alone


def test_schema_corpus_greedy_outputs_identical() -> None:
    """Every 8th schema of the corpus (tests/data/, the ones expected to compile), in one
    batch, jump-forward on vs off: the same tokens, and some were jumped."""
    corpus = json.loads(CORPUS.read_text())
    schemas = [e["schema"] for e in corpus if e["expect"] == "valid"][::8]
    params = [_params({"json": schema}) for schema in schemas]
    prompts = [f"Reply with JSON #{i}:" for i in range(len(schemas))]
    tokens, jumped = [], []
    for jump_forward in (False, True):
        llm = LLM(dtype="float32", num_blocks=256, num_threads=1, grammar_jump_forward=jump_forward)
        outputs = llm.generate(prompts, params)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        jumped.append(llm.engine.core.scheduler.num_jump_forward_tokens)
    assert len(schemas) >= 20
    assert tokens[0] == tokens[1]
    assert jumped[0] == 0 and jumped[1] > 0

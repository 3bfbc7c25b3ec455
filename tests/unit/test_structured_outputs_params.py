"""StructuredOutputsParams to grammars: validation naming the field, the cache key,
whitespace handling, and the schema features refused because xgrammar ignores them."""

from __future__ import annotations

import pytest

from kvflow.sampling_params import InvalidSamplingParams, StructuredOutputsParams
from kvflow.structured_outputs import (
    build_grammar,
    check_grammar,
    grammar_key,
    unsupported_json_features,
)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (StructuredOutputsParams(json='{"type": "nope"}'), "structured_outputs.json"),
        (StructuredOutputsParams(json="{"), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(a"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
        (StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
        (StructuredOutputsParams(), "structured_outputs"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "structured_outputs"),
    ],
)
def test_bad_constraints_name_their_field(params: StructuredOutputsParams, param: str) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        check_grammar(params)
    assert info.value.param == param


def test_cache_key_ignores_spacing_but_not_key_order_or_options() -> None:
    spaced = StructuredOutputsParams(json='{"a": 1,  "b": 2}')
    compact = StructuredOutputsParams(json={"a": 1, "b": 2})
    assert grammar_key(spaced) == grammar_key(compact)
    assert grammar_key(compact) != grammar_key(StructuredOutputsParams(json={"b": 2, "a": 1}))
    tight = StructuredOutputsParams(json={"a": 1, "b": 2}, disable_any_whitespace=True)
    assert grammar_key(tight) != grammar_key(compact)


def test_choice_literals_are_escaped_and_gbnf_comments_parse() -> None:
    text = str(build_grammar(StructuredOutputsParams(choice=['say "hi"', "a\\b"])))
    assert '"say \\"hi\\""' in text
    gbnf = "# a comment\nroot ::= [0-9]{1,3}  # digits\n"
    assert "root" in str(build_grammar(StructuredOutputsParams(grammar=gbnf)))


def test_whitespace_pattern_replaces_every_blank_slot() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = str(build_grammar(StructuredOutputsParams(json=schema, whitespace_pattern="[ ]?")))
    assert "[ \\n\\r\\t]" not in text and "kvflow_ws_root" in text


def test_unenforced_schema_keywords_are_refused() -> None:
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer"},  # a property named "not" is fine
            "tags": {"type": "array", "uniqueItems": True},
            "x": {"anyOf": [{"not": {"type": "string"}}, {"$ref": "http://x/s.json"}]},
        },
    }
    assert unsupported_json_features(schema) == [
        "$.properties.tags.uniqueItems",
        "$.properties.x.anyOf[0].not",
        "$.properties.x.anyOf[1].$ref (not local: http://x/s.json)",
    ]
    with pytest.raises(InvalidSamplingParams) as info:
        check_grammar(StructuredOutputsParams(json=schema), "response_format")
    assert info.value.param == "response_format" and "uniqueItems" in info.value.message
    check_grammar(StructuredOutputsParams(json={"oneOf": [{"type": "integer"}, {"const": "a"}]}))

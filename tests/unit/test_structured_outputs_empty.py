"""Constraints refused where requests enter, not inside the engine: schemas whose lists
or maps of sub-schemas are the wrong JSON type, and constraints no text satisfies."""

from __future__ import annotations

import json

import pytest
import xgrammar

from kvflow.empty_grammar import KNOWN_VERSIONS, unproductive_root
from kvflow.sampling_params import InvalidSamplingParams, StructuredOutputsParams
from kvflow.structured_outputs import check_grammar

SELF_DEF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
REQUIRED_SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": 5}, "$.properties must be an object"),
        ({"$defs": 1}, "$.$defs must be an object"),
        ({"definitions": [{"type": "string"}]}, "$.definitions must be an object"),
        ({"items": {"patternProperties": "x"}}, "$.items.patternProperties must be an object"),
        ({"anyOf": {"a": {"type": "string"}}}, "$.anyOf must be an array"),
    ],
)
def test_misshapen_schemas_name_the_bad_field(schema: dict[str, object], where: str) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        check_grammar(StructuredOutputsParams(json=schema), "response_format")
    assert info.value.param == "response_format"
    assert info.value.message.startswith(f"response_format: {where}"), info.value.message


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(grammar="root ::= root"),
        StructuredOutputsParams(grammar='root ::= "a" root'),  # starts, never ends
        StructuredOutputsParams(grammar='root ::= "a" x\nx ::= "b" x | x "c"'),
        StructuredOutputsParams(grammar='root ::= "a" x{1,3}\nx ::= x'),
        StructuredOutputsParams(regex="[^\\s\\S]"),
        StructuredOutputsParams(regex="ab[^\\s\\S]?c[^\\w\\W]"),
        StructuredOutputsParams(json={"$ref": "#"}),
        StructuredOutputsParams(json=SELF_DEF),
        StructuredOutputsParams(json=REQUIRED_SELF),
    ],
)
def test_constraints_matching_no_text_are_refused(params: StructuredOutputsParams) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        check_grammar(params)
    assert info.value.param == f"structured_outputs.{params.kind}"
    assert "matches no text" in info.value.message


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(grammar='root ::= "a" root | "b"'),
        StructuredOutputsParams(grammar='root ::= x{0,3} "a"\nx ::= x'),  # x unused at 0
        StructuredOutputsParams(grammar='root ::= ""'),  # the empty string is some text
        StructuredOutputsParams(regex="[^\\s]+|[\\s]"),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#"}}}),
        StructuredOutputsParams(
            json={
                "$defs": {"node": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
                "$ref": "#/$defs/node",
            }
        ),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(choice=["yes", "no"]),
    ],
)
def test_recursive_constraints_with_a_way_out_pass(params: StructuredOutputsParams) -> None:
    check_grammar(params)


def test_the_grammar_format_is_one_this_module_reads() -> None:
    """A newer xgrammar's format would turn the check off (with a warning): fail here."""
    text = xgrammar.Grammar.from_ebnf('root ::= "a"').serialize_json()
    assert json.loads(text)["__VERSION__"] in KNOWN_VERSIONS
    assert unproductive_root(xgrammar.Grammar.from_ebnf("root ::= root")) == "root"
    assert (
        unproductive_root(xgrammar.Grammar.from_ebnf('root ::= [^\\x00-\\U0010ffff] | "a"')) is None
    )

"""From `StructuredOutputsParams` to an xgrammar `Grammar`, and the grammar's cache key.

One place turns every kind of constraint into a grammar: the edges (the HTTP frontend,
the offline `LLM`) call `check_grammar` so a bad schema, regex or EBNF is a 400 before
anything reaches the engine; the engine's compile pool calls `build_grammar` again off
its loop and compiles the result against the tokenizer.

    json         -> Grammar.from_json_schema (any_whitespace unless disabled)
    json_object  -> the schema {"type": "object"}
    regex        -> Grammar.from_regex
    choice       -> EBNF  root ::= "a" | "b" | ...
    grammar      -> Grammar.from_ebnf (xgrammar's EBNF is a superset of llama.cpp's GBNF)

xgrammar is imported lazily: `import kvflow` must stay light.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvflow.empty_grammar import UnknownGrammarFormat, unproductive_root
from kvflow.sampling_params import (
    InvalidSamplingParams,
    StructuredOutputsParams,
    validate_structured_outputs,
)

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# Where JSON may put blanks: xgrammar writes this class wherever any_whitespace allows.
_JSON_BLANKS = "[ \\n\\r\\t]*"
# Blanks JSON may put in one place (xgrammar's max_whitespace_cnt). Unbounded, a small
# model at temperature 1 was seen to fill max_tokens with newlines between two keys.
MAX_JSON_BLANKS = 4
_RULE_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)
_WS_PREFIX = "kvflow_ws_"


def schema_text(schema: str | dict[str, Any]) -> str:
    """A schema's canonical text: parsed and dumped compactly, so the same schema sent
    with other spacing hits the same cache entry. Key order is kept: it is the order
    the output's properties follow."""
    value = json.loads(schema) if isinstance(schema, str) else schema
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def grammar_key(params: StructuredOutputsParams) -> str:
    """The compile cache's key: the kind, the canonical text and the whitespace options."""
    match params.kind:
        case "json":
            assert params.json is not None
            text = schema_text(params.json)
        case "choice":
            text = json.dumps(params.choice, ensure_ascii=False)
        case "json_object":
            text = ""
        case kind:
            text = getattr(params, kind)
    blanks = "compact" if params.disable_any_whitespace else (params.whitespace_pattern or "any")
    return f"{params.kind}\x00{blanks}\x00{text}"


# JSON Schema keywords xgrammar parses but does not enforce (measured: an instance that
# breaks them is accepted). A schema using one is refused, so that every output we
# return validates. `oneOf` is accepted and compiled as `anyOf`: its alternatives are
# not checked for being exclusive. `format` is enforced as the value's shape (a date
# "2023-02-30" passes): JSON Schema makes format an annotation unless asked otherwise.
_UNENFORCED = frozenset({"not", "if", "then", "else", "dependentRequired", "dependentSchemas"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
# Where a schema holds sub-schemas: one, a list of them, or a map of name -> schema.
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_json_features(schema: Any, path: str = "$") -> list[str]:
    """Where `schema` uses a keyword xgrammar would silently ignore (empty: none)."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path}.{key}" for key in sorted(_UNENFORCED & schema.keys())]
    if schema.get("uniqueItems") is True:
        found.append(f"{path}.uniqueItems")
    if "multipleOf" in schema and _BOUNDS & schema.keys():  # the bound wins, measured
        found.append(f"{path}.multipleOf (with a minimum or maximum)")
    if len(schema.get("allOf") or []) > 1:
        found.append(f"{path}.allOf (more than one schema)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{path}.$ref (not local: {ref})")
    for sub, sub_path in _subschemas(schema, path):
        found += unsupported_json_features(sub, sub_path)
    return found


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """(sub-schema, its path) of every place `schema` holds one; ValueError naming the
    field when a list or map of them is not a JSON array or object (xgrammar would
    fail on it with no word of where)."""
    for key in _ONE:
        if key in schema:
            yield schema[key], f"{path}.{key}"
    for key in _MANY:
        many = schema.get(key)
        if many is not None and not isinstance(many, list):
            raise ValueError(f"{path}.{key} must be an array of schemas, got {_json_type(many)}")
        for index, sub in enumerate(many or []):
            yield sub, f"{path}.{key}[{index}]"
    for key in _MAPS:
        named = schema.get(key)
        if named is not None and not isinstance(named, dict):
            raise ValueError(
                f"{path}.{key} must be an object of name -> schema, got {_json_type(named)}"
            )
        for name, sub in (named or {}).items():
            yield sub, f"{path}.{key}.{name}"


def _json_type(value: Any) -> str:
    """The JSON type of a decoded value, for messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return names.get(type(value), "object" if isinstance(value, dict) else "null")


def build_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The grammar; raises InvalidSamplingParams naming the field when it does not parse."""
    import xgrammar as xgr

    field = f"structured_outputs.{params.kind}"
    try:
        match params.kind:
            case "json" | "json_object":
                schema = params.json if params.json is not None else {"type": "object"}
                return _json_grammar(schema_text(schema), params)
            case "regex":
                return xgr.Grammar.from_regex(params.regex or "")
            case "choice":
                alternatives = " | ".join(_ebnf_literal(c) for c in params.choice or [])
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            case _:
                return xgr.Grammar.from_ebnf(params.grammar or "")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidSamplingParams(f"{field}: {_first_line(exc)}", param=field) from None


def check_grammar(params: StructuredOutputsParams, field: str | None = None) -> None:
    """Validate a constraint fully (it parses and matches some text); `field` renames
    the error's param to the request field it came from (e.g. response_format)."""
    try:
        validate_structured_outputs(params)
        _check_matches_some_text(build_grammar(params), params)
    except InvalidSamplingParams as exc:
        if field is None:
            raise
        # One name in the message: the inner one where it is more precise (e.g.
        # structured_outputs.json for structured_outputs), else the request's field.
        inner = exc.param or ""
        name = inner if inner.startswith(field) else field
        message = exc.message.removeprefix(f"{inner}: ")
        raise InvalidSamplingParams(f"{name}: {message}", param=field) from None


def _check_matches_some_text(grammar: xgrammar.Grammar, params: StructuredOutputsParams) -> None:
    """InvalidSamplingParams when no text satisfies the grammar: the engine would find
    no allowed token (or never an end) for the request."""
    try:
        rule = unproductive_root(grammar)
    except UnknownGrammarFormat as exc:  # a newer xgrammar: the engine still copes
        logger.warning("cannot check grammars for an empty language (format %s)", exc)
        return
    if rule is not None:
        field = f"structured_outputs.{params.kind}"
        raise InvalidSamplingParams(
            f"{field}: the constraint matches no text (its rule {rule!r} can never finish: "
            "every alternative recurses without a base case or needs an impossible character)",
            param=field,
        )


def _json_grammar(schema: str, params: StructuredOutputsParams) -> xgrammar.Grammar:
    import xgrammar

    unsupported = unsupported_json_features(json.loads(schema))
    if unsupported:
        raise ValueError(f"unsupported JSON Schema features: {', '.join(unsupported)}")

    if params.whitespace_pattern is None:
        return xgrammar.Grammar.from_json_schema(
            schema,
            any_whitespace=not params.disable_any_whitespace,
            max_whitespace_cnt=MAX_JSON_BLANKS,
            strict_mode=True,
        )
    # A custom blank pattern: the schema's EBNF with every blank slot replaced by a rule
    # built from the pattern (its rules renamed so they cannot clash with the schema's).
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=True))
    blanks = str(xgrammar.Grammar.from_regex(params.whitespace_pattern))
    for name in _RULE_NAME.findall(blanks):
        blanks = re.sub(rf"\b{name}\b", _WS_PREFIX + name, blanks)
    return xgrammar.Grammar.from_ebnf(
        ebnf.replace(_JSON_BLANKS, f"{_WS_PREFIX}root") + "\n" + blanks
    )


def _ebnf_literal(text: str) -> str:
    """A string literal in xgrammar's EBNF (JSON's escapes are a subset of its own)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(exc: BaseException) -> str:
    """xgrammar prefixes messages with a timestamp and source location: drop those."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)

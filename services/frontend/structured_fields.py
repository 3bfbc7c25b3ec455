"""The request fields that ask for structured outputs, resolved to one constraint.

Three spellings reach the HTTP API, and a request may use one of them:

    response_format      {"type": "json_object"} | {"type": "json_schema",
                          "json_schema": {"name", "schema", "strict"}} | {"type": "text"}
    structured_outputs   vLLM's object: json, regex, choice, grammar, json_object, ...
    guided_*             guided_json / _regex / _choice / _grammar (+ _whitespace_pattern):
                         vLLM's older fields, still sent by many clients

The result is checked fully here (`check_grammar`: the schema, regex or grammar parses),
so a bad one is a 400 naming the field it came from and nothing reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured_outputs import check_grammar

# Larger schemas or grammars are refused: compiling them could hold the pool for long.
MAX_GRAMMAR_CHARS = 256 * 1024


@dataclass(frozen=True)
class GuidedFields:
    """vLLM's legacy guided_* fields of a request."""

    json: str | dict[str, Any] | None
    regex: str | None
    choice: list[str] | None
    grammar: str | None
    whitespace_pattern: str | None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.json, self.regex, self.choice, self.grammar))


def resolve_structured_outputs(
    response_format: dict[str, Any] | None,
    structured_outputs: StructuredOutputsParams | None,
    legacy: GuidedFields,
) -> StructuredOutputsParams | None:
    """The one constraint of a request (None: free text); raises InvalidRequestError."""
    candidates: list[tuple[str, StructuredOutputsParams]] = []
    from_format = _from_response_format(response_format)
    if from_format is not None:
        candidates.append(("response_format", from_format))
    if structured_outputs is not None:
        candidates.append(("structured_outputs", structured_outputs))
    if legacy.given:
        candidates.append(("guided_" + _legacy_kind(legacy), _from_legacy(legacy)))
    if not candidates:
        return None
    if len(candidates) > 1:
        names = ", ".join(name for name, _ in candidates)
        raise InvalidRequestError(
            f"set only one of response_format, structured_outputs, guided_*; got {names}",
            param=candidates[1][0],
        )
    field, params = candidates[0]
    _check_size(params, field)
    check_grammar(params, field)
    # The reasoning gate is the reasoning parser's to set (reasoning.py), not a client's.
    return msgspec.structs.replace(params, reasoning_end_token_ids=None)


def _from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
            param="response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequestError(
            "response_format.json_schema must be an object with a 'name'",
            param="response_format.json_schema",
        )
    schema = spec.get("schema", {})  # OpenAI: omitted = any JSON object
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema must be a JSON object",
            param="response_format.json_schema.schema",
        )
    return StructuredOutputsParams(json=schema or {"type": "object"})


def _legacy_kind(legacy: GuidedFields) -> str:
    for kind in ("json", "regex", "choice", "grammar"):
        if getattr(legacy, kind) is not None:
            return kind
    return "json"


def _from_legacy(legacy: GuidedFields) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=legacy.json,
        regex=legacy.regex,
        choice=legacy.choice,
        grammar=legacy.grammar,
        whitespace_pattern=legacy.whitespace_pattern,
    )


def _check_size(params: StructuredOutputsParams, field: str) -> None:
    text = params.json if isinstance(params.json, str) else str(params.json or "")
    size = sum(len(s) for s in (text, params.regex or "", params.grammar or ""))
    size += sum(len(c) for c in params.choice or [])
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(
            f"{field}: the constraint is {size} characters; the limit is {MAX_GRAMMAR_CHARS}",
            param=field,
        )

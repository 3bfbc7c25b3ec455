"""Writes tests/data/json_schema_corpus.json: 200+ JSON schemas for the guided-decoding
tests, built from a fixed seed (run `python tests/data/make_schema_corpus.py` to
regenerate; the output is deterministic).

Each entry: {"name", "schema", "expect"}: expect "valid" (the output must validate) or
"unsupported" (the server must answer 400: a keyword kvflow declares unsupported).
The building blocks cover what real schemas use: nested objects, arrays with
min/maxItems, enums, const, anyOf/oneOf, $ref/$defs, patterns, formats, number bounds,
additionalProperties false and required subsets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("json_schema_corpus.json")
WORDS = ["name", "id", "city", "title", "score", "level", "tags", "kind", "owner", "note"]


def leaf(rng: random.Random) -> dict[str, Any]:
    choice = rng.randrange(12)
    if choice == 0:
        return {"type": "string", "maxLength": rng.choice([8, 12, 20])}
    if choice == 1:
        return {"type": "string", "minLength": 2, "maxLength": 10}
    if choice == 2:
        return {"type": "integer", "minimum": rng.randint(-5, 5), "maximum": rng.randint(10, 999)}
    if choice == 3:
        return {"type": "number", "minimum": 0, "maximum": 100}
    if choice == 4:
        return {"type": "boolean"}
    if choice == 5:
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2, None], 3)}
    if choice == 6:
        return {"const": rng.choice(["v1", 42, True])}
    if choice == 7:
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,6}$", "^[A-Z][0-9]{3}$"])}
    if choice == 8:
        return {"type": "string", "format": rng.choice(["date", "email", "uuid", "time"])}
    if choice == 9:
        return {"type": "integer", "multipleOf": rng.choice([2, 5])}
    if choice == 10:
        return {"type": ["string", "null"], "maxLength": 8}
    return {"type": "number", "exclusiveMaximum": 1}


def value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.25:
        return obj(rng, depth - 1)
    if depth > 0 and roll < 0.45:
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": value(rng, depth - 1),
            "minItems": low,
            "maxItems": low + rng.randint(1, 3),
        }
    if roll < 0.55:
        kind = rng.choice(["anyOf", "oneOf"])
        options = [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 6}]
        return {kind: options if kind == "anyOf" else [options[0], {"type": "boolean"}]}
    return leaf(rng)


def obj(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(WORDS, rng.randint(1, 4))
    properties = {key: value(rng, depth) for key in keys}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [key for key in keys if rng.random() < 0.7]
    if required:
        schema["required"] = required
    if rng.random() < 0.6:
        schema["additionalProperties"] = False
    return schema


def with_defs(rng: random.Random) -> dict[str, Any]:
    item = obj(rng, 0)
    return {
        "$defs": {"item": item},
        "type": "object",
        "properties": {
            "first": {"$ref": "#/$defs/item"},
            "rest": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2},
        },
        "required": ["first"],
        "additionalProperties": False,
    }


UNSUPPORTED: list[dict[str, Any]] = [
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    {"if": {"type": "integer"}, "then": {"minimum": 1}, "else": {"type": "string"}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
    {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}},
    {"type": "integer", "minimum": 1, "multipleOf": 5},
]


def corpus() -> list[dict[str, Any]]:
    rng = random.Random(20240613)
    entries = []
    for i in range(160):
        entries.append({"name": f"object-{i}", "schema": obj(rng, depth=i % 3), "expect": "valid"})
    for i in range(24):
        entries.append({"name": f"defs-{i}", "schema": with_defs(rng), "expect": "valid"})
    for i in range(16):
        schema = {"type": "array", "items": obj(rng, 0), "minItems": 1, "maxItems": 3}
        entries.append({"name": f"array-{i}", "schema": schema, "expect": "valid"})
    for i, schema in enumerate(UNSUPPORTED):
        entries.append({"name": f"unsupported-{i}", "schema": schema, "expect": "unsupported"})
    return entries


if __name__ == "__main__":
    OUT.write_text(json.dumps(corpus(), indent=1) + "\n")
    print(f"wrote {len(corpus())} schemas to {OUT}")

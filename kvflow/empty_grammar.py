"""Does a grammar match any text at all? A constraint that matches none (`root ::= root`,
the regex `[^\\s\\S]`, a JSON schema whose `$ref` loops with no base case) would let a
request start and then fail inside the engine with no allowed token; found here, it is
a 400 where the request enters.

The test is the textbook one for context-free grammars: a rule is *productive* when
one of its alternatives is a sequence of terminals and productive rules; iterate to the
fixed point. The language is empty iff the root rule is not productive. A terminal is
productive unless it is a character class that admits no character.

The grammar's structure is read from `Grammar.serialize_json()` (a versioned format):

    rules               [name, body expression id, lookahead id, ...] per rule
    grammar_expr_data   expressions back to back: [type, length, payload...]
    grammar_expr_indptr where each expression starts (the last ends with the data)

Lookaheads only narrow a language further, so they are ignored: what this finds empty
is empty, and an unknown expression type counts as productive (never a false refusal).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

# The serialization versions whose expression types are the ones below (xgrammar 0.2.8).
KNOWN_VERSIONS = frozenset({"v16"})
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES = range(7)
_REPEAT = 8  # payload: rule id, min, max
_MAX_CODEPOINT = 0x10FFFF


class UnknownGrammarFormat(Exception):
    """The grammar's serialized form is of a version this module cannot read."""


def unproductive_root(grammar: xgrammar.Grammar) -> str | None:
    """The root rule's name when the grammar matches no text at all, else None.
    Raises UnknownGrammarFormat for a serialization version not in KNOWN_VERSIONS."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") not in KNOWN_VERSIONS:
        raise UnknownGrammarFormat(str(data.get("__VERSION__")))
    exprs = _expressions(data["grammar_expr_data"], data["grammar_expr_indptr"])
    rules: list[list[Any]] = data["rules"]
    productive: set[int] = set()
    changed = True
    while changed:  # at most one pass per rule: each pass that changes adds one
        changed = False
        for rule_id, rule in enumerate(rules):
            if rule_id not in productive and _produces(exprs, rule[1], productive):
                productive.add(rule_id)
                changed = True
    root = int(data["root_rule_id"])
    return None if root in productive else str(rules[root][0])


def _expressions(flat: list[int], indptr: list[int]) -> list[tuple[int, list[int]]]:
    """(type, payload) of every expression (`indptr` holds where each one starts)."""
    ends = [*indptr[1:], len(flat)]
    return [(flat[start], flat[start + 2 : end]) for start, end in zip(indptr, ends)]


def _produces(exprs: list[tuple[int, list[int]]], expr_id: int, productive: set[int]) -> bool:
    """Whether expression `expr_id` derives some finite text, given the rules known
    productive so far."""
    kind, payload = exprs[expr_id]
    if kind in (_BYTES, _EMPTY, _CLASS_STAR):
        return True  # a class star matches the empty string
    if kind == _CLASS:
        return not _empty_class(payload)
    if kind == _RULE_REF:
        return payload[0] in productive
    if kind == _SEQUENCE:
        return all(_produces(exprs, sub, productive) for sub in payload)
    if kind == _CHOICES:
        return any(_produces(exprs, sub, productive) for sub in payload)
    if kind == _REPEAT:
        rule_id, minimum = payload[0], payload[1]
        return minimum == 0 or rule_id in productive
    return True  # unknown (e.g. a tag dispatch): assume it can end


def _empty_class(payload: list[int]) -> bool:
    """Whether a character class admits no code point: [negated, lo, hi, lo, hi, ...]."""
    negated, bounds = bool(payload[0]), payload[1:]
    ranges = sorted((lo, hi) for lo, hi in zip(bounds[::2], bounds[1::2]) if lo <= hi)
    if not negated:
        return not ranges
    covered = -1  # every code point <= covered is in some range
    for lo, hi in ranges:
        if lo > covered + 1:
            return False  # a gap: the negated class admits it
        covered = max(covered, hi)
    return covered >= _MAX_CODEPOINT

"""A depth-limited suffix tree (a suffix trie cut at `max_depth`) with occurrence counts.

It holds several token sequences ("documents"). Every start position i of a document
inserts the path doc[i : i + max_depth], so the node reached by a string s counts the
occurrences of s (|s| <= max_depth) over all documents::

    doc "a b a b c", max_depth 3        root
                                        ├─ a (2) ─ b (2) ─┬─ a (1)
                                        │                 └─ c (1)
                                        ├─ b (2) ─┬─ a (1) ─ b (1)
                                        │         └─ c (1)
                                        └─ c (1)

Invariant: a child's count is at most its parent's (each occurrence of s + c is one of
s), so a node whose count drops to 0 takes its whole subtree with it.

Appending a token extends the paths of the last max_depth - 1 start positions and
starts a new one: O(max_depth) dict operations, whatever the document's length.
Removing a document walks its paths again and decrements. Memory is O(tokens x depth)
nodes in the worst case (no repeats), far less on repetitive text.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass
class _Document:
    tokens: list[int] = field(default_factory=list)
    # Nodes ending the paths of the starts that are still shorter than max_depth,
    # oldest start first (at most max_depth - 1 of them).
    open_paths: list[_Node] = field(default_factory=list)


class Continuation(NamedTuple):
    """A proposal: the tokens and the sum of their cumulative probabilities (the expected
    number of them a sampler that agrees with the counts would accept)."""

    token_ids: list[int]
    score: float


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        assert max_depth >= 2
        self.max_depth = max_depth
        self.root = _Node()
        self.documents: dict[Hashable, _Document] = {}

    def extend(self, doc_id: Hashable, token_ids: Sequence[int]) -> None:
        """Append tokens to a document (created on first use)."""
        doc = self.documents.setdefault(doc_id, _Document())
        for token_id in token_ids:
            self._append(doc, token_id)

    def _append(self, doc: _Document, token_id: int) -> None:
        extended = []
        for node in [*doc.open_paths, self.root]:
            child = node.children.get(token_id)
            if child is None:
                child = node.children[token_id] = _Node()
            child.count += 1
            extended.append(child)
        doc.tokens.append(token_id)
        # The oldest open path has now reached max_depth when there are max_depth of them.
        doc.open_paths = extended[-(self.max_depth - 1) :]

    def remove(self, doc_id: Hashable) -> None:
        doc = self.documents.pop(doc_id, None)
        if doc is None:
            return
        tokens = doc.tokens
        for start in range(len(tokens)):
            node = self.root
            for token_id in tokens[start : start + self.max_depth]:
                child = node.children[token_id]
                child.count -= 1
                if child.count == 0:
                    del node.children[token_id]  # and its subtree, all at 0 too
                    break
                node = child

    def num_nodes(self) -> int:
        stack, total = [self.root], 0
        while stack:
            node = stack.pop()
            total += len(node.children)
            stack.extend(node.children.values())
        return total

    def find(self, tokens: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token_id in tokens:
            assert node is not None
            node = node.children.get(token_id)
            if node is None:
                return None
        return node

    def longest_match(
        self, context: Sequence[int], max_length: int | None = None
    ) -> tuple[_Node, int] | None:
        """The longest suffix of `context` (at most `max_length` and max_depth - 1 tokens,
        so that more can follow) found in the tree with a continuation: (node, length)."""
        limit = self.max_depth - 1 if max_length is None else min(max_length, self.max_depth - 1)
        for length in range(min(limit, len(context)), 0, -1):
            node = self.find(context[len(context) - length :])
            if node is not None and node.children:
                return node, length
        return None

    def continuation(self, node: _Node, max_tokens: int, min_prob: float) -> Continuation:
        """Follow the most frequent child (ties: the smallest token id) while the product
        of the conditional probabilities child.count / sum(children's counts) stays at
        least `min_prob`."""
        token_ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(token_ids) < max_tokens and node.children:
            total = sum(child.count for child in node.children.values())
            token_id, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            prob *= child.count / total
            if prob < min_prob:
                break
            token_ids.append(token_id)
            score += prob
            node = child
        return Continuation(token_ids, score)

"""Suffix decoding proposer: match the request's recent tokens in suffix trees.

Two trees (suffix_tree.py): one per request over its own prompt + output, and one
global tree over the outputs of the last `max_cached_requests` finished requests (what
agent loops and repeated edits reuse). Each step, each tree matches the longest suffix
of the request's tokens it holds with a continuation (at most max_depth - k tokens, so
that k can follow within the tree's depth), then proposes the most frequent
continuation, up to min(k, max_spec_factor x match length) tokens while its cumulative
probability stays at least `min_token_prob`. The proposal with the larger score (sum
of cumulative probabilities) wins; the request's own tree wins ties.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from kvflow.services.scheduler.spec_decode.suffix_tree import Continuation, SuffixTree
from kvflow.speculative_config import SpeculativeConfig


class SuffixProposer:
    def __init__(
        self,
        max_depth: int,
        max_cached_requests: int,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.own: dict[str, SuffixTree] = {}
        self.cache = SuffixTree(max_depth)
        self.cached_ids: OrderedDict[str, None] = OrderedDict()  # oldest first

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> SuffixProposer:
        return cls(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        tree = self.own.get(req_id)
        if tree is None:
            tree = self.own[req_id] = SuffixTree(self.max_depth)
        seen = len(tree.documents[0].tokens) if tree.documents else 0
        tree.extend(0, token_ids[seen:])
        best = self._propose_from(tree, token_ids, k)
        cached = self._propose_from(self.cache, token_ids, k)
        if cached.score > best.score:
            best = cached
        return best.token_ids

    def _propose_from(self, tree: SuffixTree, context: Sequence[int], k: int) -> Continuation:
        # Leave room for k tokens after the match: paths end at max_depth.
        match = tree.longest_match(context, max(1, self.max_depth - k))
        if match is None:
            return Continuation([], 0.0)
        node, length = match
        max_tokens = min(k, max(1, math.floor(self.max_spec_factor * length)))
        return tree.continuation(node, max_tokens, self.min_token_prob)

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop the request's own tree; cache its output for later requests."""
        self.own.pop(req_id, None)
        if self.max_cached_requests == 0 or len(token_ids) <= num_prompt_tokens:
            return
        if req_id in self.cached_ids:  # a reused id: its newer output replaces the old
            self.cache.remove(req_id)
            del self.cached_ids[req_id]
        self.cache.extend(req_id, token_ids[num_prompt_tokens:])
        self.cached_ids[req_id] = None
        while len(self.cached_ids) > self.max_cached_requests:
            oldest, _ = self.cached_ids.popitem(last=False)
            self.cache.remove(oldest)

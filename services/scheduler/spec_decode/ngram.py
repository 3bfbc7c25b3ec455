"""N-gram (prompt lookup) proposer: guess that the text repeats itself.

For n from `max_n` down to `min_n`, look up the request's last n tokens among the
n-grams that occurred earlier in its prompt + output; the first hit proposes the tokens
that followed its latest earlier occurrence::

    tokens  ... a b c d e ... x y a b c          n = 3, suffix "a b c"
                      ^ end e of the latest earlier "a b c"
    draft   d e ...                               tokens[e], tokens[e + 1], ...

The copy may run into the suffix itself (a repeating pattern): it then continues with
the tokens it has just proposed, like an overlapping LZ77 copy, so "x y x y" proposes
"x y x y ..." up to k tokens.

Each request keeps an index per n (n-gram -> latest end position that has a token
after it), extended incrementally as tokens are appended: O(max_n - min_n + 1) dict
updates per token, and a lookup costs the same, whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-gram index over its tokens (prompt + accepted outputs)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # last_end[n - min_n][ngram] = e: tokens[e - n:e] == ngram and tokens[e] exists.
        self.last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]

    def sync(self, token_ids: Sequence[int]) -> None:
        """Catch up with `token_ids`, which extends what the index has seen."""
        for token_id in token_ids[len(self.tokens) :]:
            self.append(token_id)

    def append(self, token_id: int) -> None:
        tokens = self.tokens
        end = len(tokens)  # the n-grams ending here get `token_id` as their continuation
        for n, table in enumerate(self.last_end, start=self.min_n):
            if end >= n:
                table[tuple(tokens[end - n : end])] = end
        tokens.append(token_id)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens; [] when no suffix of min_n..max_n tokens recurs."""
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.last_end[n - self.min_n].get(tuple(tokens[length - n :]))
            if end is not None:
                return overlapping_copy(tokens, end, k)
        return []


def overlapping_copy(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """tokens[start:start + k] where positions past the end read the copy itself."""
    draft: list[int] = []
    length = len(tokens)
    for j in range(k):
        pos = start + j
        draft.append(tokens[pos] if pos < length else draft[pos - length])
    return draft


class NgramProposer:
    """Drafts for many requests, each with its own index (sans-IO)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        index = self.indexes.get(req_id)
        if index is None:
            index = self.indexes[req_id] = NgramIndex(self.min_n, self.max_n)
        index.sync(token_ids)
        return index.propose(k)

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.indexes.pop(req_id, None)

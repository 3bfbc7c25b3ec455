"""Bad words (vLLM's `bad_words`): a word's token sequence may never be completed.

Each banned sequence s bans its last token s[-1] at a position whose preceding output
tokens end with s[:-1]; a one-token sequence is banned everywhere. Only the output is
matched, never the prompt: the words are banned from what the model writes.
"""

from __future__ import annotations

from collections.abc import Sequence


def banned_next_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a banned sequence right after `output`."""
    banned: list[int] = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (len(output) >= prefix and list(output[-prefix:]) == list(seq[:-1])):
            banned.append(seq[-1])
    return banned


def longest_prefix(sequences: Sequence[Sequence[int]]) -> int:
    """How many trailing output tokens a match can need."""
    return max((len(s) - 1 for s in sequences), default=0)

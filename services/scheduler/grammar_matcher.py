"""Per-request grammar state and the step's packed token bitmask.

A request's matcher has accepted exactly its known output tokens, never a placeholder
(a token a step in flight will sample): the scheduler does not plan a guided request's
next sample until its last one is back (scheduler.py), so the mask a plan carries is
the grammar's state after every token the request has. That keeps three cases exact
without any replay:
- steps in flight (async scheduling): a guided request is in at most one of them;
- preemption by recompute: the request keeps its output tokens, the matcher keeps the
  same tokens; the dropped in-flight sample was never accepted;
- a result dropped because the request left: nothing was accepted.
`replay` rebuilds a matcher from the tokens (a request resumed without its matcher),
and `rollback` undoes accepted tokens, which speculative decoding needs for rejected
drafts.

With a reasoning parser the constraint starts after the thinking: until the output holds
`reasoning_end` (`</think>`'s ids), tokens are counted but not given to the matcher, and
the mask restricts nothing. Rolling back into the thinking reopens it.

Bitmask layout (xgrammar's): row r packs token 32w + j of request r in bit j of int32
word w; 1 = allowed. Rows travel in `StepPlan.grammar_bitmask` for the requests that
sample in that step and whose grammar restricts the next token.

Filling a row is the guided path's main host cost (0.1-7.5 ms per 32 rows on this CPU,
depending on where in the grammar each request is). `fill_rows` fills every stale row
of a step in one call of xgrammar's batched filler, which spreads the rows over threads
(half the host's cores) where there are cores to spare; each row is then reused by
jump-forward's probe and by the next plan, never filled twice.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow.proto.step import GrammarBitmask

if TYPE_CHECKING:
    import xgrammar

    from kvflow.services.scheduler.request import Request


class RequestGrammar:
    """The compiled grammar of one request and the matcher over its output tokens."""

    def __init__(
        self, compiled: xgrammar.CompiledGrammar, reasoning_end: list[int] | None = None
    ) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)  # xgrammar >= 0.2 can always roll back
        self.num_accepted = 0  # thinking tokens included
        self.reasoning_end = tuple(reasoning_end or ())
        self.in_reasoning = bool(self.reasoning_end)
        self.thought: list[int] = []  # the thinking tokens, its end included
        # The next token's mask, filled once per matcher state: jump-forward fills it to
        # look for a forced token, and the next plan's bitmask reuses it.
        self._row: np.ndarray | None = None  # [1, words] int32
        self._row_restricts = False
        self._row_one_word: bool | None = None  # one nonzero word (None: not counted)
        self._row_valid = False
        self._words = (compiled.tokenizer_info.vocab_size + 31) // 32  # logits' width

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False if the grammar does not allow it."""
        if self.in_reasoning:
            self.thought.append(token_id)
            end = self.reasoning_end
            self.in_reasoning = tuple(self.thought[-len(end) :]) != end
        elif not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        self._row_valid = False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        assert 0 <= num_tokens <= self.num_accepted, num_tokens
        matched = self.num_accepted - len(self.thought)  # tokens the matcher took
        self.matcher.rollback(min(num_tokens, matched))
        if num_tokens > matched:  # back into the thinking: it is open again
            del self.thought[len(self.thought) - (num_tokens - matched) :]
            self.in_reasoning = True
        self.num_accepted -= num_tokens
        self._row_valid = False

    def replay(self, token_ids: list[int]) -> bool:
        """Start over and accept `token_ids`; False if they do not fit the grammar."""
        self.matcher.reset()
        self.num_accepted = 0
        self.thought.clear()
        self.in_reasoning = bool(self.reasoning_end)
        self._row_valid = False
        return all(self.accept(t) for t in token_ids)

    def next_row(self) -> tuple[np.ndarray, bool]:
        """The next token's mask [1, words] and whether it restricts anything (filled
        once per matcher state)."""
        if not self._row_valid:
            row = self._row_buffer()
            row.fill(-1)
            restricts = not self.in_reasoning and self.matcher.fill_next_token_bitmask(row, 0)
            self._row_restricts = bool(restricts)
            self._row_one_word = None
            self._row_valid = True
        assert self._row is not None
        return self._row, self._row_restricts

    @property
    def words(self) -> int:
        """int32 words per mask row (the logits' width / 32, rounded up)."""
        return self._words

    @property
    def row_is_stale(self) -> bool:
        return not self._row_valid

    def set_row(self, row: np.ndarray, restricts: bool, one_word: bool) -> None:
        """Take the next token's mask [words] filled elsewhere (`fill_rows`), with
        whether it restricts anything and whether one word holds all its set bits."""
        self._row_buffer()[0] = row
        self._row_restricts = restricts
        self._row_one_word = one_word
        self._row_valid = True

    def _row_buffer(self) -> np.ndarray:
        if self._row is None:
            self._row = np.empty((1, self._words), dtype=np.int32)
        return self._row

    def forced_token(self) -> int | None:
        """The one token the grammar allows next, if exactly one is allowed (a stop token
        included); None when there is a choice or the grammar has terminated."""
        if self.matcher.is_terminated():
            return None
        row, restricts = self.next_row()
        if not restricts or self._row_one_word is False:  # a choice: no scan needed
            return None
        words = np.flatnonzero(row[0])
        if len(words) != 1:
            return None
        word = int(row[0, words[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit set
            return None
        return int(words[0]) * 32 + word.bit_length() - 1

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and accepted a stop token: nothing more may follow."""
        return bool(self.matcher.is_terminated())


@functools.cache
def _batch_matcher() -> Any:  # xgrammar.BatchGrammarMatcher, made on first use
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher("auto")  # threads: half the host's cores


class _FillBuffer(threading.local):
    """The rows one `fill_rows` call fills, preallocated and grown on demand; one per
    thread, so that engines driven from several threads never share it."""

    def __init__(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.int32)

    def take(self, num_rows: int, words: int) -> np.ndarray:
        if self.rows.shape[0] < num_rows or self.rows.shape[1] != words:
            self.rows = np.empty((max(num_rows, 2 * self.rows.shape[0]), words), dtype=np.int32)
        view = self.rows[:num_rows]
        view.fill(-1)
        return view


_fill_buffer = _FillBuffer()


def fill_rows(grammars: list[RequestGrammar]) -> None:
    """Fill the stale next-token rows among `grammars` in one batched call (a row stays
    valid until its matcher moves, so nothing is filled twice)."""
    stale = [g for g in grammars if g.row_is_stale and not g.is_terminated]
    for grammar in [g for g in stale if g.in_reasoning]:  # nothing to fill while thinking
        grammar.next_row()
    stale = [g for g in stale if not g.in_reasoning]
    if len(stale) < 2:  # one row: the batched call buys nothing
        for grammar in stale:
            grammar.next_row()
        return
    words = {g.words for g in stale}
    assert len(words) == 1, words  # one engine, one vocabulary
    rows = _fill_buffer.take(len(stale), words.pop())
    _batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in stale], rows)
    # Whole-batch checks: jump-forward then scans only rows that may force one token.
    restricts = (rows != -1).any(axis=1)
    one_word = np.count_nonzero(rows, axis=1) == 1
    for i, grammar in enumerate(stale):
        grammar.set_row(rows[i], bool(restricts[i]), bool(one_word[i]))


def build_bitmask(requests: list[Request], vocab_size: int) -> GrammarBitmask | None:
    """The packed bitmask of the guided requests among `requests` (those sampling this
    step); None when no row restricts anything."""
    guided = [r for r in requests if r.grammar is not None]
    if not guided:
        return None
    fill_rows([r.grammar for r in guided if r.grammar is not None])
    words = (vocab_size + 31) // 32
    bitmask = np.empty((len(guided), words), dtype=np.int32)  # [rows, words]
    req_ids: list[str] = []
    for request in guided:
        assert request.grammar is not None
        row, restricts = request.grammar.next_row()
        assert row.shape[1] == words, (row.shape, words)
        if restricts:
            bitmask[len(req_ids)] = row[0]
            req_ids.append(request.request_id)
    if not req_ids:
        return None
    return GrammarBitmask(req_ids, words, bitmask[: len(req_ids)].tobytes())

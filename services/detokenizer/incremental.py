"""Incremental detokenization with stop strings: the sans-IO core of the detokenizer.

Text is produced by the prefix-offset / read-offset method: only a short window of
token ids is decoded per step and diffed against the text the window's head already
accounted for, so the cost per token does not grow with the output length.

    window: [ ctx ctx ctx | new new ]      (prompt tail or earlier output, then unread ids)
              ^0            ^read    ^len(window)
    prefix_text = decode(window[:read])   text already streamed (or part of the prompt)
    full        = decode(window)
    delta       = full[len(prefix_text):]  taken only once `full` does not end in U+FFFD

Decoding the head together with the new ids keeps what a lone decode would get wrong:
SentencePiece strips the leading space of the *first* token of a decode, and byte-level
or byte-fallback tokens complete a UTF-8 character only together. A `full` ending in
U+FFFD means an incomplete character: the text up to the last complete character is
emitted and the ids after it wait for more (at most `_MAX_PENDING`; beyond that the
bytes are invalid anyway and are emitted as U+FFFD, as `flush()` does at the end).

Invariants: `read` is always a clean UTF-8 boundary (the window's text up to it ended in a
complete character), so the window may be cut there without changing later text; the cut
keeps at least one token before `read`, which absorbs the first-token space stripping.
Skipped special tokens never enter the window (they decode to nothing).

Reference semantics: the streamed text (all deltas + `flush()`) equals
`decode(prompt + output)[len(P):]`, P being the prompt's complete characters, with
`clean_up_tokenization_spaces=False` (transformers' legacy space clean-up is not local
to a window and is not applied). One deliberate difference, for invalid UTF-8 only:
tokenizers' ByteFallback decoder also turns the *complete* characters of a byte run
holding an invalid byte into U+FFFD; text already streamed is never taken back.

Stop strings are matched in the output text only; the earliest-starting match wins (the
shortest at equal starts), the text is cut there, and text that could still grow into a
stop string is held back until it cannot (`flush()` releases it at the end).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from kvflow.proto.engine import DETOKENIZER_PROMPT_TAIL
from kvflow.sampling_params import SamplingParams
from kvflow.token_strings import REPLACEMENT_CHAR, fast_backend, make_decode

_REPLACEMENT = REPLACEMENT_CHAR
# Prompt tokens kept as decoding context; the start is moved back past a split character.
_PROMPT_CONTEXT = 4  # of DETOKENIZER_PROMPT_TAIL ids, kept in the window after skip ids
# Cut the window once this many tokens precede `read` (trades decode length vs. cuts).
_SLIDE_AFTER = 4
# Unread ids after which bytes that never complete a character are emitted as U+FFFD
# (an incomplete character spans at most 3 tokens; this only bounds invalid input).
_MAX_PENDING = 16


class DetokenizerUpdate(msgspec.Struct, frozen=True, gc=False):
    """What one `update()`/`flush()` produced.

    `delta` is safe to stream now. `final_text` is set when this update ended the text:
    a stop string matched (`stop_reason` is that string, the text is cut at it) or
    `flush()` was called. (A Struct: built once per token, ~10x cheaper than a frozen
    dataclass.)
    """

    delta: str = ""
    stop_reason: str | None = None
    final_text: str | None = None


_EMPTY = DetokenizerUpdate()


class _StopMatcher:
    """Finds stop strings in newly decoded text and sizes the hold-back.

    Hold-back: the longest suffix of the unstreamed text that is a proper prefix of some
    stop string is not streamed yet. Hence a stop string that completes later always
    starts inside the held text or the new text, never in text already streamed.
    `find` only reports matches that end in the new text: earlier ones either stopped
    the request already or completed before min_tokens and do not count.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        # Shortest first: at equal starts the stop that completed first wins.
        self._stops = sorted(stops, key=len)
        self._any_re = re.compile("|".join(re.escape(s) for s in self._stops))
        prefixes = [_proper_prefixes_pattern(s) for s in self._stops if len(s) > 1]
        # Anchored at the end: the leftmost match is the longest held suffix.
        self._held_re = re.compile(f"(?:{'|'.join(prefixes)})\\Z") if prefixes else None
        self._max_held = len(self._stops[-1]) - 1

    def find(self, text: str, new_start: int) -> tuple[int, str] | None:
        """(start, stop string) of the earliest match that ends after `new_start`."""
        # One regex scan rules out the usual case; a match ending after new_start
        # starts at or after new_start - _max_held.
        if self._any_re.search(text, max(0, new_start - self._max_held)) is None:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop, max(0, new_start - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def held_length(self, text: str) -> int:
        if self._held_re is None:
            return 0
        match = self._held_re.search(text, max(0, len(text) - self._max_held))
        return 0 if match is None else len(text) - match.start()


def _proper_prefixes_pattern(stop: str) -> str:
    """Regex matching exactly the non-empty proper prefixes of `stop`: "STOP" ->
    S(?:T(?:O)?)?"""
    pattern = ""
    for char in reversed(stop[1:-1]):
        pattern = f"(?:{re.escape(char)}{pattern})?"
    return re.escape(stop[0]) + pattern


class IncrementalDetokenizer:
    """Turns one request's output token ids into streamable text deltas.

    Calls after the text ended (stop string or `flush()`) return an empty update: the
    scheduler may still deliver tokens sampled before it learnt of the stop.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        skip = params.skip_special_tokens
        self._decode = make_decode(tokenizer, skip)
        self._skip_ids = _special_ids(tokenizer) if skip else frozenset()
        self._stop = _StopMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # output ids seen, skipped special ones included
        self._chunks: list[str] = []  # streamed text
        self._held = ""  # decoded, held back as a possible stop-string start
        self._stop_reason: str | None = None
        self._finished = False
        self._window, self._read, self._prefix_text = self._init_window(prompt_token_ids)

    def _init_window(self, prompt: Sequence[int]) -> tuple[list[int], int, str]:
        """Prompt tail as context, starting on a character boundary.

        If the prompt ends inside a character, `read` goes back to the last token that
        ends on a boundary (so the window can be cut there later) and the prefix text is
        all of the prompt's complete characters: the longer of the text before `read`
        and the whole tail's text without its U+FFFD (byte-level "Ġð" keeps its space;
        byte fallback turns the whole byte run into U+FFFD, so the former is longer)."""
        tail = [t for t in prompt[-DETOKENIZER_PROMPT_TAIL:] if t not in self._skip_ids]
        start = max(0, len(tail) - _PROMPT_CONTEXT)
        while start > 0 and not self._starts_character(tail[start : start + 4]):
            start -= 1
        window = tail[start:]
        n, full = len(window), self._decode(window)
        found = self._complete_prefix(window, n, max(-1, n - 4))
        if found is None:  # invalid bytes, not an unfinished character: all prompt
            return window, n, full
        read, text = found
        return window, read, max(text, full.rstrip(_REPLACEMENT), key=len)

    @property
    def output_text(self) -> str:
        """All text decoded so far, held-back characters included; once a stop string
        matched, the final text cut at it. Incomplete UTF-8 is not included."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return (self._chunks[0] if self._chunks else "") + self._held

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False
    ) -> DetokenizerUpdate:
        """Add sampled ids; return the text that can be streamed now.

        `stop_terminated`: the last id is the EOS or stop token id that finished the
        request. Its text is left out unless include_stop_str_in_output (vLLM's rule;
        the id itself stays in the output's token ids)."""
        if self._finished:
            return _EMPTY
        if stop_terminated and new_token_ids and not self._include_stop:
            self._num_tokens += 1
            new_token_ids = new_token_ids[:-1]
        window, skip = self._window, self._skip_ids
        self._num_tokens += len(new_token_ids)
        for token in new_token_ids:
            if token not in skip:
                window.append(token)
        if self._read == len(window):
            return _EMPTY
        text = self._decode_unread(force=False)
        if not text:
            return _EMPTY
        if self._stop is None:  # the common case, kept short
            self._chunks.append(text)
            return DetokenizerUpdate(text)
        return self._emit(text, final=False)

    @property
    def has_stop_strings(self) -> bool:
        return self._stop is not None

    def flush(self) -> DetokenizerUpdate:
        """The request ended without a stop string: release held-back text and any
        incomplete trailing bytes (as U+FFFD)."""
        if self._finished:
            return _EMPTY
        text = self._decode_unread(force=True) if self._read < len(self._window) else ""
        return self._emit(text, final=True)

    def _decode_unread(self, *, force: bool) -> str:
        """Text of the unread ids up to the last complete character ("" if none yet)."""
        end, full = len(self._window), self._decode(self._window)
        if full.endswith(_REPLACEMENT) and not force:
            found = self._last_complete()
            if found is None:
                return ""
            end, full = found
        prefix = self._prefix_text
        if full.startswith(prefix):
            delta = full[len(prefix) :]
        else:
            # Only for invalid bytes: tokenizers' ByteFallback decoder turns a whole run
            # of byte tokens into U+FFFD once any byte in it is invalid, changing text
            # before `read`. Streamed text cannot be taken back; emit from the change.
            delta = full[_common_prefix_length(full, prefix) :]
        self._advance(end, full)
        return delta

    def _last_complete(self) -> tuple[int, str] | None:
        """(end, text) of the longest unread prefix that ends in a complete character.

        With one new id per update there is no cut point to try: it is all or nothing."""
        n = len(self._window)
        found = self._complete_prefix(self._window, n - 1, max(self._read, n - 4))
        if found is None and n - self._read > _MAX_PENDING:
            return n, self._decode(self._window)  # not UTF-8 at all: let U+FFFD out
        return found

    def _starts_character(self, ids: list[int]) -> bool:
        """Whether ids[0] begins on a character boundary: then some ids[:j], j <= 4, is
        whole characters (a character has at most 4 bytes; a token holds at least one).
        Decoding all of `ids` would not do: byte fallback turns a whole run into U+FFFD
        when it merely ends inside a character."""
        return any(not self._decode(ids[:j]).startswith(_REPLACEMENT) for j in range(1, 5))

    def _complete_prefix(self, window: list[int], hi: int, lo: int) -> tuple[int, str] | None:
        """Largest cut c in (lo, hi] where window[:c] decodes to whole characters. An
        incomplete character is at most 3 bytes, so callers try at most 3-4 cuts."""
        for cut in range(hi, lo, -1):
            text = self._decode(window[:cut])
            if not text.endswith(_REPLACEMENT):
                return cut, text
        return None

    def _advance(self, end: int, text: str) -> None:
        """Mark window[:end] (decoding to `text`) read; cut the window if it got long."""
        old_read, self._read = self._read, end
        if old_read >= _SLIDE_AFTER:
            # Cut at the previous read offset: a clean boundary with >= 1 token after it.
            del self._window[:old_read]
            self._read -= old_read
            self._prefix_text = self._decode(self._window[: self._read])
        else:
            self._prefix_text = text

    def _emit(self, text: str, *, final: bool) -> DetokenizerUpdate:
        """Apply stop strings and hold-back to newly decoded `text`.

        Like stop token ids in the scheduler, a stop string counts only if it completes
        once the output has min_tokens tokens (hold-back works from the start, so one
        that began earlier is still caught)."""
        buf, matcher = self._held + text, self._stop
        match = None
        if matcher is not None and self._num_tokens >= self._min_tokens:
            match = matcher.find(buf, len(self._held))
        if match is not None:
            at, stop = match
            buf = buf[: at + len(stop)] if self._include_stop else buf[:at]
            self._stop_reason = stop
            final = True
        held = 0 if final or matcher is None else matcher.held_length(buf)
        out, self._held = (buf[:-held], buf[-held:]) if held else (buf, "")
        if out:
            self._chunks.append(out)
        if not final:
            return DetokenizerUpdate(out)
        self._finished = True
        return DetokenizerUpdate(out, self._stop_reason, self.output_text)


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops."""
    backend = fast_backend(tokenizer)
    if backend is not None:
        return _backend_special_ids(backend)
    return frozenset(tokenizer.all_special_ids)


@functools.lru_cache(maxsize=4)
def _backend_special_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    # Memoised per tokenizer object: listing the added tokens costs ~0.7 us each, and
    # Llama 3 has 256 reserved special ones (180 us per request uncached). A loaded
    # tokenizer's vocabulary does not change in kvflow.
    added = backend.get_added_tokens_decoder()
    return frozenset(i for i, tok in added.items() if tok.special)

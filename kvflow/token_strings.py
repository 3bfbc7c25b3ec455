"""Token ids -> text pieces, shared by the detokenizer (streams, logprob strings) and the
frontend (prompt logprobs, echo): how each token reads on its own, and the decode
functions both build on.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what a decode writes for bytes that are no whole character


def fast_backend(tokenizer: PreTrainedTokenizerBase) -> tokenizers.Tokenizer | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, tokenizers.Tokenizer) else None


def make_decode(tokenizer: PreTrainedTokenizerBase, skip: bool) -> Callable[[list[int]], str]:
    """The fastest decode that equals `tokenizer.decode(ids, skip, clean_up=False)`."""
    backend = fast_backend(tokenizer)
    if backend is not None:
        # The Rust tokenizer directly: transformers' wrapper adds ~8 us of Python per call.
        return functools.partial(backend.decode, skip_special_tokens=skip)
    return python_decode(tokenizer, skip)


def python_decode(tokenizer: PreTrainedTokenizerBase, skip: bool) -> Callable[[list[int]], str]:
    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        return cast(str, text)

    return decode


class TokenStrings:
    """The text of each token on its own, as OpenAI's logprob `token` field shows it.

    - A token is decoded after an anchor token ("a") so that a SentencePiece token keeps
      its leading space ("▁Hello" -> " Hello"; a lone decode would strip it).
    - A token holding only part of a UTF-8 character is written as "bytes:" and its bytes,
      non-printable ones as \\xNN escapes: "<0xE4>" -> "bytes:\\xe4", byte-level "Ġð"
      -> "bytes: \\xf0" (vLLM/OpenAI style; the text itself would be U+FFFD).
    - Special tokens show their text.

    A token's string never changes, so strings are cached: keep one instance per
    tokenizer (logprobs ask for up to 21 strings per generated token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        backend = fast_backend(tokenizer)
        anchor: int | None
        if backend is not None:
            self._decode: Callable[[list[int]], str] = functools.partial(
                backend.decode, skip_special_tokens=False
            )
            self._to_token: Callable[[int], str | None] = backend.id_to_token
            anchor = backend.token_to_id("a")
        else:
            self._decode = python_decode(tokenizer, skip=False)
            self._to_token = tokenizer.convert_ids_to_tokens  # type: ignore[assignment]
            anchor = tokenizer.convert_tokens_to_ids("a")  # type: ignore[assignment]
            anchor = None if anchor == tokenizer.unk_token_id else anchor
        self._anchor = [] if anchor is None else [anchor]
        self._anchor_len = len(self._decode(self._anchor))
        self._cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        cache = self._cache
        return [cache[i] if i in cache else self._compute(i) for i in ids]

    def _compute(self, token_id: int) -> str:
        piece = self._decode([*self._anchor, token_id])[self._anchor_len :]
        text = _readable(piece, self._to_token(token_id))
        self._cache[token_id] = text
        return text


def convert_ids_to_token_strings(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]
) -> list[str]:
    """One-off `TokenStrings(tokenizer)(ids)`; see TokenStrings for the format."""
    return TokenStrings(tokenizer)(ids)


def _readable(piece: str, token: str | None) -> str:
    if REPLACEMENT_CHAR not in piece or token is None:
        return piece
    raw = _token_bytes(token)
    # Trust the byte interpretation only if it reproduces the tokenizer's own decode.
    if raw is None or raw.decode("utf-8", errors="replace") != piece:
        return piece
    return "bytes:" + "".join(
        chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw
    )


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(token: str) -> bytes | None:
    """Raw bytes of a byte-fallback ("<0xE4>") or GPT-2 byte-level ("Ġð") token."""
    m = _BYTE_FALLBACK.fullmatch(token)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    if not all(c in _BYTE_LEVEL_TABLE for c in token):
        return None
    return bytes(_BYTE_LEVEL_TABLE[c] for c in token)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable Latin-1 bytes stand for
    themselves, every other byte b is chr(256 + n) for the n-th such byte in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


_BYTE_LEVEL_TABLE = _byte_level_table()

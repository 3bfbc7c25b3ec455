"""Reasoning parsers: whole texts, and the same texts streamed cut at every position."""

from __future__ import annotations

import pytest

from kvflow.errors import ConfigError
from kvflow.services.frontend.reasoning import REASONING_PARSERS, reasoning_parser

CASES = [
    # (parser, text, reasoning, content)
    ("qwen3", "<think>why so</think>the answer", "why so", "the answer"),
    ("qwen3", "<think>\nstep 1\n</think>\n\nok", "\nstep 1\n", "\n\nok"),
    ("qwen3", "plain answer, thinking off", None, "plain answer, thinking off"),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "a < b </think>", None, "a < b </think>"),
    ("deepseek_r1", "why so</think>the answer", "why so", "the answer"),
    ("deepseek_r1", "<think>why</think>answer", "why", "answer"),
    ("deepseek_r1", "still thinking <", "still thinking <", None),
    ("deepseek_r1", "</think>only content", "", "only content"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_text_split(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert REASONING_PARSERS[name].split(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_stream_cut_anywhere_gives_the_same_split(
    name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    parser = REASONING_PARSERS[name]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream = parser.stream()
            pieces = [stream.feed(p) for p in (text[:i], text[i:j], text[j:])]
            pieces.append(stream.finish())
            got_reasoning = "".join(r for r, _ in pieces)
            got_content = "".join(c for _, c in pieces)
            assert got_reasoning == (reasoning or ""), (i, j)
            assert got_content == (content or ""), (i, j)


def test_reasoning_streams_before_content_and_tags_cut_across_deltas() -> None:
    stream = REASONING_PARSERS["qwen3"].stream()
    out = [stream.feed(p) for p in ["<th", "ink>ab", "c</th", "ink", ">de", "f"]]
    assert out == [("", ""), ("ab", ""), ("c", ""), ("", ""), ("", "de"), ("", "f")]


def test_unknown_parser_lists_the_known_ones() -> None:
    assert reasoning_parser(None) is None
    with pytest.raises(ConfigError, match="deepseek_r1, qwen3"):
        reasoning_parser("nope")

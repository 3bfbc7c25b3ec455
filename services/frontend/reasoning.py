"""Reasoning parsers (`kvflow serve --reasoning-parser NAME`): a chat choice's generated
text split at its think tags into `reasoning_content` and `content`.

    qwen3:        "<think>why</think>answer"  -> reasoning "why", content "answer";
                  no opening tag (thinking off) -> all of it is content
    deepseek_r1:  "why</think>answer"          -> the same split: the template opens the
                  thinking in the prompt, so the output starts inside it (an opening tag
                  it writes anyway is dropped); no closing tag -> all of it is reasoning

A stream is split as it comes (`ReasoningStream.feed`): a tag cut across deltas is held
back until it is complete or cannot be one, so clients see the same split either way.
Tool calls and structured content are read from the content only, never the thinking,
and a request's constraint (structured outputs, a forced tool call) is enforced from the
end tag on (`gate_after_reasoning`): the engine leaves the thinking free. With
`chat_template_kwargs` `enable_thinking: false` (or `thinking: false`) the template
closes the thinking in the prompt, so the constraint applies from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.errors import ConfigError
from kvflow.sampling_params import SamplingParams

_OPEN, _THINKING, _CONTENT = range(3)


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_thinking: bool  # the prompt already opened the thinking
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole text; None where there is none."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if stream.thought else None), (content or None)


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", starts_in_thinking=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_thinking=True),
}


AUTO = "auto"  # --reasoning-parser auto: chosen from the chat template (auto_reasoning_parser)


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of that name (None: none); an unknown name is a ConfigError. `auto`
    is resolved by the frontend once its tokenizer is loaded (auto_reasoning_parser)."""
    if name is None or name == AUTO:
        return None
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        known = ", ".join([*sorted(REASONING_PARSERS), AUTO])
        raise ConfigError(f"unknown reasoning parser {name!r}; known: {known}")
    return parser


def auto_reasoning_parser(tokenizer: Any) -> str | None:
    """The parser a chat template implies, where that is unambiguous: a generation
    prompt that ends inside an opened `<think>` is deepseek_r1's; a template that
    writes think tags otherwise is qwen3's; no think tags, no parser."""
    from kvflow.tokenizer import apply_chat_template

    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<think>" not in template:
        return None
    probe = [{"role": "user", "content": "hi"}]
    prompt = apply_chat_template(tokenizer, probe, True, None, None)
    text = str(tokenizer.decode(prompt, skip_special_tokens=False))
    return "deepseek_r1" if text.rstrip().endswith("<think>") else "qwen3"


def gate_after_reasoning(
    params: SamplingParams,
    parser: ReasoningParser | None,
    tokenizer: Any,
    template_kwargs: dict[str, Any] | None,
) -> SamplingParams:
    """`params` with its constraint starting after the thinking's end tag, where the
    output will think first."""
    guided = params.structured_outputs
    kwargs = template_kwargs or {}
    thinking_off = kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False
    if guided is None or parser is None or thinking_off:
        return params
    end = list(tokenizer.encode(parser.end_tag, add_special_tokens=False))
    gated = msgspec.structs.replace(guided, reasoning_end_token_ids=end)
    return msgspec.structs.replace(params, structured_outputs=gated)


class ReasoningStream:
    """One choice's text deltas in, (reasoning, content) pieces out."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = _OPEN
        self.pending = ""  # text that may still be the start of a tag
        self.thought = False  # some text was (or is being) thinking

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        if self.state == _OPEN:
            start = self.parser.start_tag
            if self.pending.startswith(start):
                self.pending = self.pending[len(start) :]
                self._enter_thinking()
            elif start.startswith(self.pending):
                return "", ""  # maybe the opening tag, not yet whole
            elif self.parser.starts_in_thinking:
                self._enter_thinking()
            else:
                self.state = _CONTENT
        if self.state == _THINKING:
            return self._think()
        content, self.pending = self.pending, ""
        return "", content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice ended."""
        rest, self.pending = self.pending, ""
        if self.state == _THINKING or (self.state == _OPEN and self.parser.starts_in_thinking):
            self.thought = self.thought or bool(rest)
            return rest, ""
        return "", rest

    def _enter_thinking(self) -> None:
        self.state, self.thought = _THINKING, True

    def _think(self) -> tuple[str, str]:
        end = self.parser.end_tag
        at = self.pending.find(end)
        if at >= 0:
            reasoning, content = self.pending[:at], self.pending[at + len(end) :]
            self.state, self.pending = _CONTENT, ""
            return reasoning, content
        keep = _partial_tag_length(self.pending, end)
        cut = len(self.pending) - keep
        reasoning, self.pending = self.pending[:cut], self.pending[cut:]
        return reasoning, ""


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag cut by a delta)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0

"""Reasoning in chat choices (serving_chat's _Choice, fed engine deltas as the frontend
is) and chat_template_kwargs reaching the template."""

from __future__ import annotations

from typing import Any

import msgspec
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvflow.proto.frontend import RequestOutputDelta
from kvflow.services.frontend.protocol import ChatCompletionRequest
from kvflow.services.frontend.reasoning import REASONING_PARSERS
from kvflow.services.frontend.responses import ChatChunkChoice
from kvflow.services.frontend.serving_chat import _Choice
from kvflow.services.frontend.tool_calling import ToolSpec, tool_use
from kvflow.tokenizer import apply_chat_template

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
TOOLS = [msgspec.convert({"type": "function", "function": ADD}, ToolSpec)]
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)


def think_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte, plus ChatML specials and the think tags as tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials[:3]])
    tok.add_tokens([AddedToken(s, special=False) for s in specials[3:]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", chat_template=THINKING_TEMPLATE
    )


def run(choice: _Choice, pieces: list[str]) -> list[ChatChunkChoice]:
    chunks = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = RequestOutputDelta("r", text, [0], finish_reason="stop" if last else None)
        chunks.append(choice.apply(None, delta))  # type: ignore[arg-type]
    return chunks


def test_streamed_reasoning_comes_before_content_and_whole_message_splits() -> None:
    tokenizer = think_tokenizer()
    ids = tokenizer.encode("<think>let me see</think>It is 4.", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]  # one delta per token, as the engine sends
    assert "<think>" in pieces and "</think>" in pieces
    choice = _Choice(0, False, tool_use(None, None, True), REASONING_PARSERS["qwen3"])
    deltas = [c.delta for c in run(choice, pieces)]
    reasoning = [d.reasoning_content for d in deltas if d.reasoning_content]
    content = [d.content for d in deltas if d.content]
    assert "".join(reasoning) == "let me see" and "".join(content) == "It is 4."
    last_reasoning = max(i for i, d in enumerate(deltas) if d.reasoning_content)
    first_content = min(i for i, d in enumerate(deltas) if d.content)
    assert last_reasoning < first_content
    message = choice.final("").message
    assert (message.reasoning_content, message.content) == ("let me see", "It is 4.")


def test_without_a_parser_the_tags_stay_in_the_content() -> None:
    choice = _Choice(0, False, tool_use(None, None, True), None)
    run(choice, ["<think>a</think>", "b"])
    message = msgspec.json.decode(msgspec.json.encode(choice.final("").message))
    assert message == {"role": "assistant", "content": "<think>a</think>b"}


def test_tool_calls_are_parsed_from_the_content_not_the_thinking() -> None:
    thought = 'maybe <tool_call>{"name": "add", "arguments": {"a": 9}}</tool_call>?'
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text = f"{thought}</think>{call}"
    for streamed in (False, True):
        choice = _Choice(0, False, tool_use(TOOLS, "auto", True), REASONING_PARSERS["deepseek_r1"])
        chunks = run(choice, list(text) if streamed else [text])
        final = choice.final("")
        assert final.message.reasoning_content == thought
        calls = final.message.tool_calls
        assert isinstance(calls, list) and [c.function.arguments for c in calls] == ['{"a": 1}']
        streamed_calls = [t for c in chunks for t in c.delta.tool_calls or []]
        assert {t.index for t in streamed_calls} == {0}
        assert '"a": 9' not in "".join(
            t.function.arguments or "" for t in streamed_calls if t.function
        )


def test_chat_template_kwargs_reach_the_template() -> None:
    tokenizer = think_tokenizer()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    plain = msgspec.convert(body, ChatCompletionRequest)
    off = msgspec.convert({**body, "chat_template_kwargs": {"enable_thinking": False}},
                          ChatCompletionRequest)  # fmt: skip
    with_thinking = apply_chat_template(
        tokenizer, plain.conversation(), template_kwargs=plain.chat_template_kwargs
    )
    without = apply_chat_template(
        tokenizer, off.conversation(), template_kwargs=off.chat_template_kwargs
    )
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    assert think_end not in with_thinking and think_end in without
    # The function's own arguments cannot be replaced by a request.
    same = apply_chat_template(
        tokenizer, plain.conversation(), template_kwargs={"add_generation_prompt": False}
    )
    assert same == with_thinking

"""A resumed stream's choice (kv_resume, the proxy's) absorbs the text the old stream sent
before its first new delta: reasoning and tool-call parsing, usage and text offsets go on
as in one uninterrupted run, and nothing the client has is sent again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.services.frontend.reasoning import REASONING_PARSERS
from kvflow.services.frontend.serving_chat import _Choice as ChatChoice
from kvflow.services.frontend.serving_common import PreparedPrompt
from kvflow.services.frontend.serving_completions import _Choice as CompletionChoice
from kvflow.services.frontend.tool_calling import ToolSpec, tool_use

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
TOOLS = [msgspec.convert({"type": "function", "function": ADD}, ToolSpec)]
TEXT = '<think>a sum</think>Adding. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
PIECES = [TEXT[i : i + 3] for i in range(0, len(TEXT), 3)]  # one "token" each


def _chat_choice() -> ChatChoice:
    return ChatChoice(0, False, tool_use(TOOLS, "auto", True), REASONING_PARSERS["qwen3"])


def _run(choice: ChatChoice, start: int, resumed_text: str = "") -> dict[str, Any]:
    """Feed PIECES[start:] (token ids = piece positions); what the client was sent."""
    sent: dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "finish": None}
    for i in range(start, len(PIECES)):
        finish = "stop" if i == len(PIECES) - 1 else None
        delta = RequestOutputDelta("r", PIECES[i], [i], finish_reason=finish)
        if i == start:
            delta.resumed_text = resumed_text
        part = choice.apply(None, delta)  # type: ignore[arg-type]
        sent["reasoning"] += part.delta.reasoning_content or ""
        sent["content"] += part.delta.content or ""
        sent["calls"] += [(c.function.name, c.function.arguments)
                          for c in part.delta.tool_calls or []]  # fmt: skip
        sent["finish"] = part.finish_reason or sent["finish"]
    return sent


def _message(choice: ChatChoice) -> dict[str, Any]:
    message = msgspec.to_builtins(choice.final("").message)
    for call in message.get("tool_calls", []):
        call.pop("id")  # a new one each time
    return message


@pytest.mark.parametrize("k", [1, 3, 5, 8, 12, len(PIECES) - 1])
def test_a_chat_choice_resumed_after_k_tokens_equals_one_uninterrupted_run(k: int) -> None:
    whole = _chat_choice()
    expected = _run(whole, 0)
    assert expected["reasoning"] == "a sum" and expected["content"] == "Adding. "
    assert expected["calls"] == [("add", '{"a": 1}')] and expected["finish"] == "tool_calls"

    old = _chat_choice()  # the stream that broke: PIECES[:k]
    before: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
    for i in range(k):
        part = old.apply(None, RequestOutputDelta("r", PIECES[i], [i]))  # type: ignore[arg-type]
        before["reasoning"] += part.delta.reasoning_content or ""
        before["content"] += part.delta.content or ""
    resumed = _chat_choice()
    resumed.resume(list(range(k)), finished=False)
    after = _run(resumed, k, resumed_text="".join(PIECES[:k]))

    assert before["reasoning"] + after["reasoning"] == expected["reasoning"]
    assert before["content"] + after["content"] == expected["content"]
    assert after["calls"] == expected["calls"] and after["finish"] == expected["finish"]
    assert _message(resumed) == _message(whole)
    assert resumed.num_tokens == whole.num_tokens == len(PIECES)
    assert resumed.token_ids == whole.token_ids


def test_only_the_first_delta_brings_the_old_text() -> None:
    choice = _chat_choice()
    choice.resume([0], finished=False)
    choice.apply(None, RequestOutputDelta("r", "b", [1], resumed_text="<think>a"))  # type: ignore[arg-type]
    # An in-server re-route later re-sends the text of every token so far: already had.
    choice.apply(None, RequestOutputDelta("r", "c", [2], resumed_text="<think>ab"))  # type: ignore[arg-type]
    assert "".join(choice.text) == "<think>abc"


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_completion_choice_resumed_keeps_echo_once_and_offsets_going_on() -> None:
    tokenizer = _byte_tokenizer()
    ctx = SimpleNamespace(tokenizer=tokenizer, token_strings=lambda entry, strings: strings)
    prompt = PreparedPrompt(tokenizer.encode("Hi"), "Hi", None)  # type: ignore[arg-type]
    output = tokenizer.encode(" there, you")

    def delta(i: int, resumed_text: str = "") -> RequestOutputDelta:
        piece = tokenizer.decode([output[i]])
        return RequestOutputDelta("r", piece, [output[i]], resumed_text=resumed_text,
                                  logprobs=[TokenLogprobs([output[i]], [-0.5], 1)],
                                  logprob_tokens=[[piece]])  # fmt: skip

    whole = CompletionChoice(0, prompt, "Hi", True)
    for i in range(len(output)):
        whole.apply(ctx, delta(i))  # type: ignore[arg-type]
    k = 6  # " there" sent, then the break
    resumed = CompletionChoice(0, prompt, "Hi", True)
    resumed.resume(output[:k], finished=False)
    part = resumed.apply(ctx, delta(k, resumed_text=" there"))  # type: ignore[arg-type]
    assert part.text == ","  # no echo again: the client has it
    for i in range(k + 1, len(output)):
        resumed.apply(ctx, delta(i))  # type: ignore[arg-type]
    assert whole.logprobs is not None and resumed.logprobs is not None
    assert resumed.logprobs.text_offset == whole.logprobs.text_offset[-(len(output) - k) :]
    assert resumed.final().text == whole.final().text == "Hi there, you"
    assert resumed.num_tokens == whole.num_tokens == len(output)

"""Reasoning in the Responses API (a `reasoning` item before the answer, its events as
OpenAI's client types read them) and the constraint gated after the thinking."""

from __future__ import annotations

import msgspec
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent
from test_chat_reasoning import think_tokenizer

from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.services.frontend.reasoning import (
    REASONING_PARSERS,
    auto_reasoning_parser,
    gate_after_reasoning,
)
from kvflow.services.frontend.responses_events import event_type
from kvflow.services.frontend.responses_input import input_messages, output_messages
from kvflow.services.frontend.responses_output import OutputBuilder
from kvflow.services.frontend.responses_protocol import (
    InputItem,
    OutputMessage,
    ReasoningItem,
)
from kvflow.services.frontend.tool_calling import tool_use

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def build(parser: str, pieces: list[str], finish: str = "stop") -> tuple[OutputBuilder, list]:
    builder = OutputBuilder(tool_use(None, None, True), REASONING_PARSERS[parser])
    events = [e for piece in pieces for e in builder.feed(piece)]
    events += builder.finish(finish)
    for number, event in enumerate(events):
        event.sequence_number = number
    return builder, events


def pieces_of(text: str) -> list[str]:
    tokenizer = think_tokenizer()
    return [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]


@pytest.mark.parametrize(
    ("parser", "text"),
    [("qwen3", "<think>let me see</think>It is 4."), ("deepseek_r1", "let me see</think>It is 4.")],
)
def test_thinking_is_a_reasoning_item_before_the_message(parser: str, text: str) -> None:
    builder, events = build(parser, pieces_of(text))
    reasoning, message = builder.output
    assert isinstance(reasoning, ReasoningItem) and isinstance(message, OutputMessage)
    assert reasoning.content[0].text == "let me see" and builder.text == "It is 4."
    assert reasoning.status == "completed"
    # Every event is one the openai client parses, and the reasoning closes first.
    parsed = [EVENTS.validate_python(msgspec.to_builtins(e)) for e in events]
    names = [event_type(e) for e in events]
    assert [p.type for p in parsed] == names
    done = names.index("response.reasoning_text.done")
    assert done < names.index("response.output_text.delta")
    deltas = [p.delta for p in parsed if p.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "let me see"
    assert {p.output_index for p in parsed if "reasoning" in p.type} == {0}


def test_a_thought_cut_by_the_length_limit_is_incomplete() -> None:
    builder, _ = build("deepseek_r1", pieces_of("still thinking"), finish="length")
    (reasoning,) = builder.output  # no answer began: no message item, as OpenAI's
    assert isinstance(reasoning, ReasoningItem) and reasoning.status == "incomplete"
    assert reasoning.content[0].text == "still thinking" and builder.text == ""


def test_reasoning_items_sent_back_stay_out_of_the_prompt() -> None:
    builder, _ = build("qwen3", pieces_of("<think>hmm</think>Yes."))
    assert output_messages(builder.output) == [{"role": "assistant", "content": "Yes."}]
    back = msgspec.convert(
        [
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hmm"}],
            },
            {"role": "user", "content": "And?"},
        ],
        list[InputItem],
    )
    assert input_messages(back) == [{"role": "user", "content": "And?"}]


def test_the_constraint_is_gated_after_the_end_tag() -> None:
    tokenizer = think_tokenizer()
    end = tokenizer.encode("</think>", add_special_tokens=False)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    qwen3 = REASONING_PARSERS["qwen3"]
    gated = gate_after_reasoning(params, qwen3, tokenizer, None)
    assert gated.structured_outputs is not None
    assert gated.structured_outputs.reasoning_end_token_ids == end
    off = gate_after_reasoning(params, qwen3, tokenizer, {"enable_thinking": False})
    assert off.structured_outputs is not None
    assert off.structured_outputs.reasoning_end_token_ids is None  # closed in the prompt
    assert gate_after_reasoning(params, None, tokenizer, None) is params
    free = SamplingParams()
    assert gate_after_reasoning(free, qwen3, tokenizer, None) is free


R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n<think>\n"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    ("template", "chosen"),
    [(None, "qwen3"), (R1_TEMPLATE, "deepseek_r1"), (PLAIN_TEMPLATE, None)],
)
def test_auto_parser_follows_the_chat_template(template: str | None, chosen: str | None) -> None:
    tokenizer = think_tokenizer()  # its own template: Qwen3's enable_thinking switch
    if template is not None:
        tokenizer.chat_template = template
    assert auto_reasoning_parser(tokenizer) == chosen

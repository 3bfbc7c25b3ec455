"""POST /v1/responses: the request body and the response object as msgspec Structs.

Names and shapes follow OpenAI's Responses API (what the `openai` client sends and
parses), plus vLLM's sampling extras (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop, seed, priority, cache_salt) and kvflow's `timeout`. Unknown fields
are ignored, as on the other routes.

An input item is one flat Struct rather than a union: OpenAI's message items may omit
`type`, which a msgspec tagged union cannot express. `type` is an enum, so an unknown
item type is a 400 naming `input[i].type`; the fields each type needs are checked when
the items are mapped to chat messages (responses_input.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvflow.services.frontend.protocol import Count, Int32, Int64, MaxTokens, Penalty, Text, Timeout

# A "reasoning" item sent back is accepted and left out of the prompt, as chat templates
# leave earlier turns' thinking out.
ItemType = Literal["message", "function_call", "function_call_output", "reasoning"]
InputRole = Literal["system", "developer", "user", "assistant"]


class InputContentPart(msgspec.Struct, kw_only=True):
    """input_text (a user/system turn) or output_text (an assistant turn sent back)."""

    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class InputItem(msgspec.Struct, kw_only=True):
    type: ItemType = "message"
    # message
    role: InputRole | None = None
    content: str | list[InputContentPart] | None = None
    # function_call (call_id, name, arguments) and function_call_output (call_id, output)
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None
    status: str | None = None
    # reasoning (left out of the prompt)
    summary: list[InputContentPart] | None = None
    encrypted_content: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """Responses' flat function tool: {"type": "function", "name", "parameters", ...}."""

    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    name: str | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: Text | Annotated[list[InputItem], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: MaxTokens | None = None  # None: fill the context
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    min_tokens: Count | None = None
    ignore_eos: bool = False
    stop: Text | list[Text] | None = None
    seed: Int64 | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: list[Int32] | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    timeout: Timeout | None = None


# --- the response object ---------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: str  # in_progress | completed | incomplete
    role: str = "assistant"
    content: list[OutputText] = msgspec.field(default_factory=list)


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningText(msgspec.Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """The thinking (with --reasoning-parser), before the answer's items."""

    id: str
    status: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: str | None = None


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(
        cls, input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0
    ) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=input_tokens + output_tokens,
        )


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str  # max_output_tokens


class ResponseObject(msgspec.Struct, kw_only=True):
    """What POST returns, what response.* events carry, and what GET reads back."""

    id: str
    object: str = "response"
    created_at: int
    status: str  # in_progress | completed | incomplete
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    usage: ResponseUsage | None = None
    error: Any = None  # kvflow answers failures with an HTTP error, never a failed response
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    user: str | None = None
    truncation: str = "disabled"

"""OpenAI response bodies and stream chunks as msgspec Structs (encoded with msgspec.json).

Shapes follow OpenAI's API reference; `stop_reason` is vLLM's extra (the stop string or
token id that ended a choice). Fields a client reads as "absent or null" are encoded as
null, as OpenAI does, except in chat deltas, where only the fields that changed appear.
"""

from __future__ import annotations

import msgspec


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


# --- /v1/completions -------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Parallel lists, one entry per token of the choice's text (echoed prompt first)."""

    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # return_token_ids (vLLM's extra): the choice's prompt and output ids; else absent.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions --------------------------------------------------------------


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes_: list[int] | None = msgspec.field(default=None, name="bytes")


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes_: list[int] | None = msgspec.field(default=None, name="bytes")
    top_logprobs: list[ChatTopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallOut


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call; clients join pieces by `index`."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    # Absent unless a reasoning parser is configured (--reasoning-parser).
    reasoning_content: str | msgspec.UnsetType | None = msgspec.UNSET
    # Absent unless the choice called tools (UNSET fields are not encoded).
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# --- models, tokenizer -----------------------------------------------------------------


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kvflow"
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model (None: a base model)


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str

"""OpenAI request bodies as msgspec Structs, and their conversion to `SamplingParams`.

Bodies are decoded straight into these types (`decode_request`); msgspec rejects wrong
types and out-of-range integers with a message naming the field, which becomes a 400.
Unknown fields are ignored (OpenAI clients send extras such as `parallel_tool_calls`).
OpenAI's nullable fields accept `null` and mean "the default"; range checks of floats
live in `SamplingParams.validate`, the one place the engine's limits are spelled out.

Field names and meanings follow OpenAI, plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, prompt_logprobs, priority, cache_salt) so vLLM clients port over.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # OpenAI's own cap on `n`; also bounds the fan-out one request can cause
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# Integers that must fit the MessagePack wire and the engine's int32/int64 tensors.
Int32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the one served model
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    user: str | None = None
    echo: bool | None = False
    # vLLM extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    speculative: bool = True  # kvflow: false opts this request out of speculative decoding

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def _sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            n=_or(self.n, 1),
            max_tokens=max_tokens,
            min_tokens=_or(self.min_tokens, 0),
            temperature=_or(self.temperature, 1.0),
            top_k=_or(self.top_k, 0),
            top_p=_or(self.top_p, 1.0),
            min_p=_or(self.min_p, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias),
            seed=self.seed,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids or None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            speculative=self.speculative,
        )


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: Count | None = 16  # OpenAI's default; null fills the context
    logprobs: Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a text or token ids (OpenAI's four forms)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [[int(p) for p in prompt]]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token id lists (not a mix)",
            param="prompt",
        )

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != _or(self.n, 1):
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens carry logprobs too (OpenAI's scoring idiom).
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(
            max_tokens=self.max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs
        )


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined)."""
        if self.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"unknown role {self.role!r}; expected one of {sorted(CHAT_ROLES)}",
                param="messages",
            )
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported (text only)",
                    param="messages",
                )
        return "\n".join(part.text or "" for part in self.content)


Messages = Annotated[list[ChatMessage], Meta(min_length=1)]


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Messages
    max_tokens: Count | None = None  # deprecated by OpenAI in favour of the next one
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        return [message.to_dict() for message in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.tools:
            raise InvalidRequestError("tool calling is not supported", param="tools")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequestError(
                "response_format other than text is not supported", param="response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs needs logprobs set to true", param="top_logprobs"
            )
        max_tokens = _or(self.max_completion_tokens, self.max_tokens)
        logprobs = _or(self.top_logprobs, 0) if self.logprobs else None
        return self._sampling_params(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs
        )


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


RequestT = TypeVar("RequestT")
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Decode a JSON body; raises msgspec.DecodeError/ValidationError (both 400)."""
    decoder = _DECODERS.get(request_type)
    if decoder is None:
        decoder = _DECODERS[request_type] = msgspec.json.Decoder(request_type)
    return decoder.decode(body)  # type: ignore[no-any-return]


ValueT = TypeVar("ValueT")


def _or(value: ValueT | None, default: ValueT) -> ValueT:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            result[int(key)] = float(value)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return result

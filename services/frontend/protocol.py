"""OpenAI request bodies as msgspec Structs, and their conversion to `SamplingParams`.

Bodies are decoded straight into these types (`decode_request`); msgspec rejects wrong
types and out-of-range integers with a message naming the field, which becomes a 400.
Unknown fields are ignored (OpenAI clients send extras), logged and named in a response
header (ignored_fields.py).
OpenAI's nullable fields accept `null` and mean "the default"; range checks of floats
live in `SamplingParams.validate`, the one place the engine's limits are spelled out.

Field names and meanings follow OpenAI, plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, prompt_logprobs, allowed_token_ids, bad_words, truncate_prompt_tokens,
return_token_ids, priority, cache_salt) so vLLM clients port over.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from kvflow.errors import InvalidRequestError
from kvflow.proto.sampling import KVTransferParams
from kvflow.sampling_params import (
    MAX_LOGPROBS,
    BeamSearch,
    SamplingParams,
    StructuredOutputsParams,
)
from kvflow.services.frontend.json_limits import check_json_limits
from kvflow.services.frontend.kv_params import KVResume
from kvflow.services.frontend.structured_fields import GuidedFields, resolve_structured_outputs
from kvflow.services.frontend.tool_calling import ToolChoice, ToolSpec, tool_guide

MAX_N = 128  # OpenAI's own cap on `n`; also bounds the fan-out one request can cause
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]

# Integers that must fit the MessagePack wire and the engine's int32/int64 tensors.
Int32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]  # SamplingParams.validate: >= 1
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Text = Annotated[str, Meta(min_length=1)]  # an empty prompt has nothing to condition on
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]
# The ranges SamplingParams.validate enforces, stated here too so that /openapi.json
# tells clients (tests/unit/test_openapi_limits.py checks that the two agree).
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Bias = Annotated[float, Meta(ge=-100, le=100)]
# Seconds; the frontend aborts the request after this long (request_deadline.py).
Timeout = Annotated[float, Meta(gt=0, le=1e6)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the one served model
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (as a JSON key) -> bias
    user: str | None = None
    echo: bool | None = False
    # vLLM extras
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    min_tokens: Count | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    return_token_ids: bool | None = False  # prompt_token_ids and each choice's token_ids
    priority: Int32 = 0
    cache_salt: str | None = None
    data_parallel_rank: Annotated[int, Meta(ge=0)] | None = None  # the engine to use
    timeout: Timeout | None = None  # kvflow's extra: abort after this many seconds
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the
    # guided_* fields vLLM removed (clients still send them). At most one of the three.
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: xgrammar decides
    speculative: bool = True  # kvflow: false opts this request out of speculative decoding
    # Beam search (vLLM's names): best_of (completions) or n beams; n results.
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    kv_transfer_params: KVTransferParams | None = None  # P/D: where the prompt's KV comes from
    kv_resume: KVResume | None = None  # P/D: a broken stream's tokens so far (kv_params.py)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def _sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        best_of: int | None = None,
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        beam_search = self._beam_search(best_of)
        return SamplingParams(
            n=_or(self.n, 1),
            max_tokens=max_tokens,
            min_tokens=_or(self.min_tokens, 0),
            # Beam search ranks the model's logprobs: temperature 0 unless one is given.
            temperature=_or(self.temperature, 1.0 if beam_search is None else 0.0),
            top_k=_or(self.top_k, 0),
            top_p=_or(self.top_p, 1.0),
            min_p=_or(self.min_p, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            seed=self.seed,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids or None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self._structured_outputs(),
            speculative=self.speculative,
            kv_transfer_params=self.kv_transfer_params,
            beam_search=beam_search,
        )

    def _beam_search(self, best_of: int | None) -> BeamSearch | None:
        """The search vLLM's `use_beam_search` asks for (its other rules, such as
        temperature 0 and n <= best_of, are the sampling parameters' checks)."""
        if not self.use_beam_search:
            for name, value, default in (
                ("length_penalty", self.length_penalty, 1.0),
                ("early_stopping", self.early_stopping, False),
            ):
                if value not in (None, default):
                    raise InvalidRequestError(
                        f"{name} is used only with use_beam_search", param=name
                    )
            if best_of is not None and best_of != _or(self.n, 1):
                raise InvalidRequestError(
                    "best_of other than n needs use_beam_search (it is the beam width)",
                    param="best_of",
                )
            return None
        return BeamSearch(
            beam_width=_or(best_of, _or(self.n, 1)),
            length_penalty=_or(self.length_penalty, 1.0),
            early_stopping=False if self.early_stopping is None else self.early_stopping,
        )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        legacy = GuidedFields(
            self.guided_json,
            self.guided_regex,
            self.guided_choice,
            self.guided_grammar,
            self.guided_whitespace_pattern,
        )
        return resolve_structured_outputs(self.response_format, self.structured_outputs, legacy)


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Text | Annotated[list[Text | TokenId | TokenIds], Meta(min_length=1)]
    max_tokens: MaxTokens | None = 16  # OpenAI's default; null fills the context
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
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens carry logprobs too (OpenAI's scoring idiom).
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            best_of=self.best_of,
        )


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None  # accepted, not used (the model's processor sets the size)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None  # type "image_url" (kvflow/media.py: where from)


class ChatMessage(msgspec.Struct):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def to_dict(self, image_text: str | None = None) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined; an image
        part as `image_text`, the model's image token)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text(image_text)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self, image_text: str | None = None) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type == "image_url" and part.image_url is not None:
                if image_text is None:
                    raise InvalidRequestError(
                        "this model takes text only: image_url parts need a vision model",
                        param="messages",
                    )
                texts.append(image_text)
            elif part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported (text, image_url)",
                    param="messages",
                )
            else:
                texts.append(part.text)
        return "\n".join(texts)

    def image_urls(self) -> list[str]:
        if self.content is None or isinstance(self.content, str):
            return []
        return [p.image_url.url for p in self.content if p.image_url is not None]


Messages = Annotated[list[ChatMessage], Meta(min_length=1)]


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Messages
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI in favour of the next one
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None  # template variables (enable_thinking)

    def conversation(self, image_text: str | None = None) -> list[dict[str, Any]]:
        return [message.to_dict(image_text) for message in self.messages]

    def image_urls(self) -> list[str]:
        """The image_url parts' URLs, in the order the conversation shows them."""
        return [url for message in self.messages for url in message.image_urls()]

    def to_sampling_params(self) -> SamplingParams:
        params = self._chat_sampling_params()
        guide = tool_guide(self.tools, self.tool_choice, _or(self.parallel_tool_calls, True))
        if guide is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        return msgspec.structs.replace(params, structured_outputs=guide)

    def _chat_sampling_params(self) -> SamplingParams:
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
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


RequestT = TypeVar("RequestT")
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Decode a JSON body; raises InvalidRequestError (bad UTF-8, nesting too deep) or
    msgspec.DecodeError/ValidationError, all three a 400."""
    check_json_limits(body)
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

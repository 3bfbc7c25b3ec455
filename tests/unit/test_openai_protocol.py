"""OpenAI request decoding, conversion to SamplingParams, and error mapping (no server)."""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
import pytest
from starlette.responses import Response

from kvflow.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from kvflow.model_limits import check_prompt
from kvflow.sampling_params import (
    InvalidSamplingParams,
    SamplingParams,
    child_request_ids,
    child_sampling_params,
    validate_sampling_params,
)
from kvflow.services.frontend.errors import RequestTooLargeError, error_info
from kvflow.services.frontend.ignored_fields import (
    IGNORED_FIELDS_HEADER,
    ignored_fields,
    mark_ignored,
)
from kvflow.services.frontend.in_flight import sample_index
from kvflow.services.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    decode_request,
)
from kvflow.services.frontend.serving_chat import token_bytes


def completion(**body: Any) -> CompletionRequest:
    return decode_request(msgspec.json.encode(body), CompletionRequest)


def chat(**body: Any) -> ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def status_and_param(exc: BaseException) -> tuple[int, str | None]:
    status, info = error_info(exc)
    return int(status), info.param


def decode_error(body: bytes, request_type: type = CompletionRequest) -> tuple[int, str | None]:
    with pytest.raises(msgspec.DecodeError) as info:  # ValidationError is a DecodeError
        decode_request(body, request_type)
    return status_and_param(info.value)


# --- decoding --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_the_four_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], ["a", 1], [[1], 2], [[1], "a"]])
def test_bad_prompt_lists(prompt: Any) -> None:
    # An empty list is refused by the schema (minItems), mixes by prompts().
    with pytest.raises((InvalidRequestError, msgspec.ValidationError)) as info:
        completion(prompt=prompt).prompts()
    assert status_and_param(info.value) == (400, "prompt")


def test_unknown_fields_and_nulls_are_accepted_and_unknown_ones_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = {
        "prompt": "x",
        "temperature": None,
        "stop": None,
        "seed": None,
        "n": None,
        "echo": None,
        "some_future_field": {"a": 1},
        "another_unknown": 2,
    }
    params = completion(**body).to_sampling_params()
    assert params == SamplingParams(max_tokens=16)
    raw = json.dumps(body).encode()
    with caplog.at_level(logging.WARNING, logger="kvflow.services.frontend.ignored_fields"):
        assert ignored_fields(raw, CompletionRequest) == ["another_unknown", "some_future_field"]
        assert ignored_fields(raw, CompletionRequest) == ["another_unknown", "some_future_field"]
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warned) == 2  # once per field name, however many requests carry it
    assert all(("'some_future_field'" in m) != ("'another_unknown'" in m) for m in warned)
    response = mark_ignored(Response(), ["another_unknown", "some_future_field", "bad\nname"])
    assert response.headers[IGNORED_FIELDS_HEADER] == "another_unknown,some_future_field"
    assert IGNORED_FIELDS_HEADER not in mark_ignored(Response(), []).headers


def test_vllm_sampling_extras_reach_sampling_params() -> None:
    body = {
        "prompt": "x",
        "allowed_token_ids": [3, 4],
        "bad_words": ["foo"],
        "truncate_prompt_tokens": 5,
        "return_token_ids": True,
    }
    params = completion(**body).to_sampling_params()
    assert params.allowed_token_ids == [3, 4] and params.bad_words == ["foo"]
    assert params.truncate_prompt_tokens == 5
    with pytest.raises(InvalidSamplingParams):
        validate_sampling_params(SamplingParams(allowed_token_ids=[]), 10)
    with pytest.raises(InvalidSamplingParams):
        validate_sampling_params(SamplingParams(allowed_token_ids=[10]), 10)
    with pytest.raises(InvalidSamplingParams):
        validate_sampling_params(SamplingParams(truncate_prompt_tokens=0), 10)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "n": "two"}', "n"),
        (b'{"prompt": "x", "n": 1.5}', "n"),
        (b'{"prompt": "x", "stream": 1}', "stream"),
        (b'{"prompt": "x", "logprobs": 6}', "logprobs"),
        (b'{"prompt": "x", "logprobs": -1}', "logprobs"),
        (b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
        (b'{"prompt": "x", "seed": 1e30}', "seed"),
        (b'{"prompt": [1, -2]}', "prompt[1]"),
        (b'{"prompt": "x", "stop": [1]}', "stop[0]"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}',
            "stream_options.include_usage",
        ),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": "x", "logit_bias": {"1": "big"}}', "logit_bias[...]"),
    ],
)
def test_wrong_types_are_400_naming_the_field(body: bytes, param: str) -> None:
    assert decode_error(body) == (400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "user"}], "top_logprobs": 21}', "top_logprobs"),
        (b'{"messages": [{"role": "user"}], "logprobs": 3}', "logprobs"),
    ],
)
def test_chat_wrong_types(body: bytes, param: str) -> None:
    assert decode_error(body, ChatCompletionRequest) == (400, param)


@pytest.mark.parametrize("body", [b'{"prompt": ', b"", b'{"prompt": "x"} trailing'])
def test_malformed_json_is_400_without_param(body: bytes) -> None:
    assert decode_error(body) == (400, None)


@pytest.mark.parametrize("body", [b"\xff\xfe", b'{"prompt": "\xc3("}', b"[" * 200 + b"]" * 200])
def test_not_utf8_or_too_deep_is_400_without_param(body: bytes) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_request(body, CompletionRequest)
    assert status_and_param(info.value) == (400, None)


def test_top_level_must_be_an_object() -> None:
    assert decode_error(b'["prompt"]') == (400, None)


# --- conversion to SamplingParams -------------------------------------------------------


def test_completion_to_sampling_params() -> None:
    request = completion(
        prompt="x",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=3,
        stop="END",
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"5": 2.5, "7": -100},
        logprobs=2,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[3],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    assert request.to_sampling_params() == SamplingParams(
        n=3,
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={5: 2.5, 7: -100.0},
        seed=11,
        stop=["END"],
        stop_token_ids=[3],
        include_stop_str_in_output=True,
        ignore_eos=True,
        logprobs=2,
        skip_special_tokens=False,
    )


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert completion(prompt="x", echo=True, logprobs=3).to_sampling_params().prompt_logprobs == 3
    assert completion(prompt="x", echo=True).to_sampling_params().prompt_logprobs is None
    params = completion(prompt="x", echo=True, logprobs=1, prompt_logprobs=4).to_sampling_params()
    assert params.prompt_logprobs == 4


def test_completion_defaults_and_null_max_tokens() -> None:
    assert completion(prompt="x").to_sampling_params().max_tokens == 16
    assert completion(prompt="x", max_tokens=None).to_sampling_params().max_tokens is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"suffix": "s"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_completion_conversion_errors(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        completion(prompt="x", **body).to_sampling_params()
    assert status_and_param(info.value) == (400, param)


def test_chat_max_tokens_and_logprobs() -> None:
    assert chat().to_sampling_params().max_tokens is None  # fills the context
    assert chat(max_tokens=5).to_sampling_params().max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).to_sampling_params().logprobs == 4
    assert chat(logprobs=False).to_sampling_params().logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [{"function": {"name": "f"}}]}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ],
)
def test_chat_conversion_errors(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(**body).to_sampling_params()
    assert status_and_param(info.value) == (400, param)


def test_chat_text_parts_are_joined_and_other_parts_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "user", "content": parts, "name": "bob"}])
    assert request.conversation() == [{"role": "user", "content": "a\nb", "name": "bob"}]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(InvalidRequestError) as info:
        chat(messages=[{"role": "user", "content": image}]).conversation()
    assert info.value.param == "messages"
    with pytest.raises(msgspec.ValidationError):  # roles are an enum of the schema
        chat(messages=[{"role": "robot", "content": "x"}])
    assert chat(messages=[{"role": "assistant", "content": None}]).conversation() == [
        {"role": "assistant", "content": ""}
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop": ["a", ""]}, "stop"),
        ({"logit_bias": {"99": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"stop_token_ids": [50]}, "stop_token_ids"),
    ],
)
def test_validation_of_values_is_400(body: dict[str, Any], param: str) -> None:
    # Ranges the schema states fail while decoding, the rest in validate().
    with pytest.raises((InvalidRequestError, msgspec.ValidationError)) as info:
        validate_sampling_params(completion(prompt="x", **body).to_sampling_params(), vocab_size=50)
    status, got = status_and_param(info.value)
    assert (status, (got or "").split("[")[0]) == (400, param)


def test_tokenize_request_forms() -> None:
    request = decode_request(b'{"prompt": "x", "add_special_tokens": false}', TokenizeRequest)
    assert (request.prompt, request.messages, request.add_special_tokens) == ("x", None, False)


# --- n > 1 fan-out ------------------------------------------------------------------------


def test_child_requests() -> None:
    params = SamplingParams(n=3, seed=5, temperature=0.7)
    children = [child_sampling_params(params, i) for i in range(3)]
    assert [(c.n, c.seed, c.temperature) for c in children] == [
        (1, 5, 0.7),
        (1, 6, 0.7),
        (1, 7, 0.7),
    ]
    unseeded = SamplingParams(n=2)
    assert [child_sampling_params(unseeded, i).seed for i in range(2)] == [None, None]
    single = SamplingParams(seed=9)
    assert child_sampling_params(single, 0) is single
    assert child_request_ids("r", 1) == ["r"]
    assert child_request_ids("r", 3) == ["r#0", "r#1", "r#2"]
    assert [sample_index(i) for i in ["r", "r#0", "r#2", "cmpl-1-0#11"]] == [0, 0, 2, 11]


# --- lengths --------------------------------------------------------------------------------


def test_check_prompt_resolves_max_tokens() -> None:
    prompt = list(range(10))
    assert check_prompt(prompt, None, 64, 100) == 54
    assert check_prompt(prompt, 54, 64, 100) == 54
    with pytest.raises(PromptTooLongError) as info:
        check_prompt(prompt, 55, 64, 100)
    assert info.value.param == "max_tokens"
    for prompt_len in (64, 65):
        with pytest.raises(PromptTooLongError) as info:
            check_prompt([1] * prompt_len, None, 64, 100)
        assert status_and_param(info.value) == (400, "prompt")
    for bad in ([], [100]):
        with pytest.raises(InvalidRequestError) as info:
            check_prompt(bad, None, 64, 100)
        assert status_and_param(info.value) == (400, "prompt")


# --- error mapping ----------------------------------------------------------------------------


def test_error_statuses() -> None:
    assert status_and_param(ModelNotFoundError("no such model")) == (404, "model")
    assert status_and_param(RequestTooLargeError(10)) == (413, None)
    assert status_and_param(EngineDeadError("worker died")) == (503, None)
    assert status_and_param(InvalidRequestError("bad", param="x")) == (400, "x")


def test_unexpected_errors_are_500_with_a_generic_message(caplog: pytest.LogCaptureFixture) -> None:
    status, info = error_info(RuntimeError("secret detail"))
    assert (int(status), info.message, info.type) == (500, "internal server error", "server_error")
    assert "secret detail" in caplog.text  # logged for the operator, not sent to the client


def test_token_bytes() -> None:
    assert token_bytes("é") == [0xC3, 0xA9]
    assert token_bytes("bytes:\\xe4\\xb8") == [0xE4, 0xB8]
    assert token_bytes("bytes: \\xf0") == [0x20, 0xF0]

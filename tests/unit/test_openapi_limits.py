"""The ranges the request schema states (and msgspec enforces while decoding) are the
ones `SamplingParams.validate` enforces in the engine: at each boundary both accept or
both refuse. A schema stricter than the engine would refuse valid requests; a looser
one would mislead clients generated from /openapi.json."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams, validate_sampling_params
from kvflow.services.frontend.protocol import CompletionRequest, decode_request

# (request field, value, the SamplingParams field it becomes)
BOUNDARIES: list[tuple[str, Any]] = [
    ("temperature", 0.0),
    ("temperature", -1e-9),
    ("top_p", 1.0),
    ("top_p", 1.0000001),
    ("top_p", 0.0),
    ("top_p", 1e-9),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("min_p", -1e-9),
    ("min_p", 1.0000001),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("presence_penalty", 2.0000001),
    ("frequency_penalty", -2.0000001),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-9),
    ("top_k", -1),
    ("top_k", -2),
    ("top_k", 0),
    ("max_tokens", 1),
    ("max_tokens", 0),
    ("min_tokens", 0),
    ("min_tokens", -1),
    ("n", 1),
    ("n", 0),
    ("stop", [""]),
    ("stop", ["x"]),
]


def _schema_accepts(field: str, value: Any) -> bool:
    body = msgspec.json.encode({"prompt": "x", "max_tokens": 8, field: value})
    try:
        decode_request(body, CompletionRequest)
    except msgspec.ValidationError:
        return False
    return True


def _engine_accepts(field: str, value: Any) -> bool:
    try:
        validate_sampling_params(SamplingParams(**{"max_tokens": 8, field: value}), vocab_size=100)
    except InvalidRequestError:
        return False
    return True


@pytest.mark.parametrize(("field", "value"), BOUNDARIES)
def test_schema_and_engine_agree_at_the_boundaries(field: str, value: Any) -> None:
    assert _schema_accepts(field, value) == _engine_accepts(field, value)


@pytest.mark.parametrize(("bias", "ok"), [(100.0, True), (-100.0, True), (100.5, False)])
def test_logit_bias_range_agrees(bias: float, ok: bool) -> None:
    assert _schema_accepts("logit_bias", {"5": bias}) is ok
    assert _engine_accepts("logit_bias", {5: bias}) is ok

"""Per-request sampling parameters.

`SamplingParams` is a msgspec Struct so it crosses process boundaries as MessagePack
unchanged; `validate()` is the one place its values are checked and raises
`InvalidSamplingParams` (a 400 at the HTTP layer) with a message naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.kv_transfer_config import KVTransferParams

# Upper bound on top-N logprobs per token (OpenAI allows 20 for chat, 5 for completions).
MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


class InvalidSamplingParams(InvalidRequestError):
    """A sampling field is out of range or inconsistent."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Guided decoding: exactly one constraint; the output can only be text it allows.

    json: a JSON schema (text or a dict); regex: a regular expression; choice: one of
    these strings exactly; grammar: EBNF (llama.cpp's GBNF is accepted as is); json_object:
    any JSON object. `disable_any_whitespace` makes JSON compact (no optional blanks);
    `whitespace_pattern` is a regex for the blanks JSON may use instead.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @property
    def kind(self) -> str:
        """Which constraint: json | regex | choice | grammar | json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def validate(self) -> None:
        """Exactly one constraint. Whether it parses is checked where requests enter
        (`kvflow.structured_outputs.check_grammar`), not on the engine's loop."""
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        _check(
            len(given) == 1,
            "structured_outputs",
            f"exactly one of json, regex, choice, grammar, json_object must be set, got {given}",
        )
        if self.choice is not None:
            _check(bool(self.choice), "structured_outputs.choice", "must not be empty")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token (+ the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True  # False: never speculate for this request (opt-out)
    # Disaggregated prefill/decode: where this request's prompt KV comes from.
    kv_transfer_params: KVTransferParams | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """top_k with "off" normalised to 0."""
        return 0 if self.top_k in (0, -1) else self.top_k

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidSamplingParams for any out-of-range field."""
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be >= 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(
            self.top_k >= -1, "top_k", f"must be -1 or 0 (off) or a positive int, got {self.top_k}"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                name,
                f"must be in [0, {MAX_LOGPROBS}], got {value}",
            )
        self._validate_token_ids(vocab_size)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if self.stop is not None:
            _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        if vocab_size is None:
            return
        for tok in self.stop_token_ids or []:
            _check(0 <= tok < vocab_size, "stop_token_ids", f"token id {tok} is out of vocabulary")
        for tok, bias in (self.logit_bias or {}).items():
            _check(0 <= tok < vocab_size, "logit_bias", f"token id {tok} is out of vocabulary")
            _check(
                -100.0 <= bias <= 100.0, "logit_bias", f"bias must be in [-100, 100], got {bias}"
            )


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(f"{field}: {message}", param=field)


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of n runs as its own request: n=1, and a seeded request's samples
    get seeds seed+index, so they differ from each other yet stay reproducible."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

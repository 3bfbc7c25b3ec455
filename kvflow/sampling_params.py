"""Per-request sampling parameters: the one place their values are checked.

`SamplingParams` itself is a msgspec Struct of the wire (`kvflow.proto.sampling`), so it
crosses process boundaries as MessagePack unchanged. `validate_sampling_params()` raises
`InvalidSamplingParams` (a 400 at the HTTP layer) with a message naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.proto.sampling import (
    BeamSearch,
    KVTransferParams,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "MAX_LOGPROBS",
    "BeamSearch",
    "BeamSearchParams",
    "InvalidSamplingParams",
    "KVTransferParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "child_request_ids",
    "child_sampling_params",
    "truncate_prompt",
    "validate_sampling_params",
    "validate_structured_outputs",
    "with_bad_words_token_ids",
]

# Upper bound on top-N logprobs per token (OpenAI allows 20 for chat, 5 for completions).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s parameters (vLLM's names). `early_stopping` is transformers'
    rule for when the search ends (True, False or "never"). Every beam is returned."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # must be 0: the search ranks the model's logprobs
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        search = BeamSearch(
            beam_width=self.beam_width,
            num_outputs=self.beam_width,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
        return SamplingParams(
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            include_stop_str_in_output=self.include_stop_str_in_output,
            beam_search=search,
        )


class InvalidSamplingParams(InvalidRequestError):
    """A sampling field is out of range or inconsistent."""


def validate_sampling_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise InvalidSamplingParams for any out-of-range field."""
    _check(params.n >= 1, "n", f"must be >= 1, got {params.n}")
    _check(
        params.max_tokens is None or params.max_tokens >= 1,
        "max_tokens",
        f"must be >= 1, got {params.max_tokens}",
    )
    _check(params.min_tokens >= 0, "min_tokens", f"must be >= 0, got {params.min_tokens}")
    _check(
        params.max_tokens is None or params.min_tokens <= params.max_tokens,
        "min_tokens",
        f"must be <= max_tokens ({params.max_tokens}), got {params.min_tokens}",
    )
    _check(params.temperature >= 0.0, "temperature", f"must be >= 0, got {params.temperature}")
    _check(
        params.top_k >= -1, "top_k", f"must be -1 or 0 (off) or a positive int, got {params.top_k}"
    )
    _check(0.0 < params.top_p <= 1.0, "top_p", f"must be in (0, 1], got {params.top_p}")
    _check(0.0 <= params.min_p <= 1.0, "min_p", f"must be in [0, 1], got {params.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
    _check(
        params.repetition_penalty > 0.0,
        "repetition_penalty",
        f"must be > 0, got {params.repetition_penalty}",
    )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        _check(
            value is None or 0 <= value <= MAX_LOGPROBS,
            name,
            f"must be in [0, {MAX_LOGPROBS}], got {value}",
        )
    _check(
        params.truncate_prompt_tokens is None
        or params.truncate_prompt_tokens >= 1
        or params.truncate_prompt_tokens == -1,
        "truncate_prompt_tokens",
        f"must be >= 1 or -1, got {params.truncate_prompt_tokens}",
    )
    _check(
        params.allowed_token_ids is None or bool(params.allowed_token_ids),
        "allowed_token_ids",
        "must not be empty",
    )
    _check(
        all(params.bad_words_token_ids or ()),
        "bad_words",
        "a bad word must have tokens",
    )
    _validate_token_ids(params, vocab_size)
    if params.structured_outputs is not None:
        validate_structured_outputs(params.structured_outputs)
    if params.stop is not None:
        _check(all(s for s in params.stop), "stop", "stop strings must be non-empty")
    if params.beam_search is not None:
        _validate_beam_search(params, params.beam_search)


# Fields that edit or constrain sampling; beam search ranks the model's raw logprobs.
_NOT_WITH_BEAM_SEARCH = (
    ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("min_tokens", 0),
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
    ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None),
    ("structured_outputs", None), ("logprobs", None), ("prompt_logprobs", None),
)  # fmt: skip


def _validate_beam_search(params: SamplingParams, beam: BeamSearch) -> None:
    """vLLM's rules for `use_beam_search` (temperature 0, n <= best_of), and no field
    the search would ignore."""
    _check(beam.beam_width >= 1, "best_of", f"beam width must be >= 1, got {beam.beam_width}")
    _check(
        params.n <= beam.beam_width and beam.num_outputs <= beam.beam_width,
        "best_of",
        f"best_of must be greater than or equal to n, got n={max(params.n, beam.num_outputs)} "
        f"and best_of={beam.beam_width}",
    )
    _check(params.greedy, "temperature", "temperature must be 0 when using beam search")
    _check(
        beam.early_stopping in (True, False, "never"),
        "early_stopping",
        f"must be true, false or 'never', got {beam.early_stopping!r}",
    )
    # Beyond this, length ** length_penalty leaves float range for long outputs.
    _check(
        -50.0 <= beam.length_penalty <= 50.0,
        "length_penalty",
        f"must be in [-50, 50], got {beam.length_penalty}",
    )
    for name, default in _NOT_WITH_BEAM_SEARCH:
        value = getattr(params, name)
        off = value == default or (name == "top_k" and value == -1)
        _check(off, name, f"is not used with beam search (got {value!r})")


def _validate_token_ids(params: SamplingParams, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    for tok in params.stop_token_ids or []:
        _check(0 <= tok < vocab_size, "stop_token_ids", f"token id {tok} is out of vocabulary")
    for tok in params.allowed_token_ids or []:
        _check(0 <= tok < vocab_size, "allowed_token_ids", f"token id {tok} is out of vocabulary")
    for word in params.bad_words_token_ids or []:
        for tok in word:
            _check(0 <= tok < vocab_size, "bad_words", f"token id {tok} is out of vocabulary")
    for tok, bias in (params.logit_bias or {}).items():
        _check(0 <= tok < vocab_size, "logit_bias", f"token id {tok} is out of vocabulary")
        _check(-100.0 <= bias <= 100.0, "logit_bias", f"bias must be in [-100, 100], got {bias}")


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Exactly one constraint. Whether it parses is checked where requests enter
    (`kvflow.structured_outputs.check_grammar`), not on the engine's loop."""
    given = [n for n in ("json", "regex", "choice", "grammar") if getattr(params, n) is not None]
    given += ["json_object"] if params.json_object else []
    _check(
        len(given) == 1,
        "structured_outputs",
        f"exactly one of json, regex, choice, grammar, json_object must be set, got {given}",
    )
    if params.choice is not None:
        _check(bool(params.choice), "structured_outputs.choice", "must not be empty")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(f"{field}: {message}", param=field)


def with_bad_words_token_ids(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with each bad word's token sequences filled in: the word as written
    (leading blanks stripped) and, where it tokenizes differently, after a space, as
    the word reads mid-text (vLLM's rule)."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    sequences: list[list[int]] = []
    for word in params.bad_words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        if spaced and spaced != bare:
            sequences.append(spaced)
    return msgspec.structs.replace(params, bad_words_token_ids=sequences)


def truncate_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The last `truncate_prompt_tokens` of the prompt (-1: of max_model_len), else all."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if keep >= 1 else token_ids


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of n runs as its own request: n=1, and a seeded request's samples
    get seeds seed+index, so they differ from each other yet stay reproducible."""
    if params.beam_search is not None:  # one search; each request takes one result
        beam = msgspec.structs.replace(params.beam_search, num_outputs=params.n)
        return msgspec.structs.replace(params, n=1, beam_search=beam)
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

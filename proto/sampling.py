"""The sampling parameters' wire form: what a request asks of the sampler, as it crosses
every process boundary (frontend -> scheduler -> worker) as MessagePack.

Values are checked where requests enter (`kvflow.sampling_params.validate_sampling_params`),
not here: these Structs are data only.
"""

from __future__ import annotations

from typing import Any

import msgspec

_GREEDY_EPS = 1e-5


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    """Per request (vLLM's `kv_transfer_params` body field): where its KV comes from.
    Unknown keys that vLLM clients send are ignored."""

    remote_address: str | None = None  # "tcp://host:port" of the zmq producer
    do_remote_decode: bool = False  # a proxy's prefill request: its KV is for elsewhere
    # The proxy's signature over remote_address, request_id and expires_at (unix
    # seconds): a consumer honours remote_address only when it matches
    # (services/frontend/kv_params.py).
    request_id: str | None = None
    expires_at: float | None = None
    signature: str | None = None


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Guided decoding: exactly one constraint; the output can only be text it allows.

    json: a JSON schema (text or a dict); regex: a regular expression; choice: one of
    these strings exactly; grammar: EBNF (llama.cpp's GBNF is accepted as is); json_object:
    any JSON object. `disable_any_whitespace` makes JSON compact (no optional blanks);
    `whitespace_pattern` is a regex for the blanks JSON may use instead.
    `reasoning_end_token_ids` (set by the frontend's reasoning parser, never by a client):
    the constraint starts after the output contains these tokens, so the thinking before
    them is free text.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning_end_token_ids: list[int] | None = None

    @property
    def kind(self) -> str:
        """Which constraint: json | regex | choice | grammar | json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class BeamSearch(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Beam search (vLLM's `use_beam_search`): `beam_width` beams explore the output,
    and the best `num_outputs` finished ones are returned, one per engine request
    ("<id>#<index>", as for n samples). `length_penalty` divides a finished beam's
    logprob by its length ** length_penalty; `early_stopping` (True, False or "never")
    is transformers' rule for when the search ends."""

    beam_width: int
    num_outputs: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False


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
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Banned words; a word's token sequences (with and without a leading space) are
    # filled in where the tokenizer is (`bad_words_token_ids`), before the engine.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: max_model_len)
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
    beam_search: BeamSearch | None = None  # the engine searches instead of sampling

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """top_k with "off" normalised to 0."""
        return 0 if self.top_k in (0, -1) else self.top_k

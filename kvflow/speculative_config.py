"""Speculative decoding configuration, in vLLM's `--speculative-config` JSON shape.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    LLM(speculative_config={"method": "suffix", "num_speculative_tokens": 8})

Methods:
- `ngram`: prompt lookup; the longest suffix of the request's tokens (prompt + output)
  of `prompt_lookup_min`..`prompt_lookup_max` tokens that occurred before proposes what
  followed its latest earlier occurrence.
- `suffix`: a depth-limited suffix tree over the request's own tokens and over the
  outputs of recent requests (a cache of `suffix_decoding_max_cached_requests`).
- `draft_model`: a smaller model with the target's tokenizer (`model`: an HF directory
  or a GGUF file) runs in the worker beside the target with its own paged KV cache and
  proposes k tokens for every speculating request (gpu_worker/drafter.py). The
  scheduler sends `WORKER_DRAFT_TOKEN` placeholders in the plan; the worker fills them.

Off-switches: speculation stops for the whole batch above `disable_by_batch_size`
running requests, and for one request while its acceptance rate over its last
`acceptance_window` drafted tokens is below `min_acceptance_rate`. Its default is the
method's measured break-even rate (`BREAK_EVEN_ACCEPTANCE`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from kvflow.errors import ConfigError
from kvflow.json_options import json_options

SpecMethod = Literal["ngram", "suffix", "draft_model"]
# A draft the worker's draft model fills in (the scheduler only reserves its slot).
WORKER_DRAFT_TOKEN = -1

# The acceptance rate below which speculating costs more than it saves, measured per
# method: a = (c - 1) / k, where c is a verification step's time over a plain step's,
# from `kvflow bench spec-decode --measure-cost` (n-gram, every draft rejected; suffix
# has the same verification step) and from the draft_model run (its k draft forwards
# included) of docs/benchmarks.md, which has the commands, the machine and the figures.
# A draft model much larger relative to its target than the one measured (the target's
# first half) costs more: set min_acceptance_rate from that bench run's `break_even`.
BREAK_EVEN_ACCEPTANCE: dict[str, float] = {"ngram": 0.046, "suffix": 0.046, "draft_model": 0.52}
METHODS: tuple[str, ...] = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int
    # ngram
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 128
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model
    model: str | None = None
    # off-switches
    disable_by_batch_size: int | None = None
    acceptance_window: int = 32
    min_acceptance_rate: float | None = None  # None: BREAK_EVEN_ACCEPTANCE[method]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ConfigError("suffix_decoding_max_tree_depth must be >= 2")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ConfigError("suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError("suffix_decoding_min_token_prob must be in [0, 1]")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("`model` is required by draft_model and only by it")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError("disable_by_batch_size must be >= 1")
        if self.min_acceptance_rate is None:
            object.__setattr__(self, "min_acceptance_rate", BREAK_EVEN_ACCEPTANCE[self.method])
        if self.acceptance_window < 1 or not 0.0 <= self.acceptance_rate_floor <= 1.0:
            raise ConfigError("need acceptance_window >= 1 and 0 <= min_acceptance_rate <= 1")

    @property
    def acceptance_rate_floor(self) -> float:
        """`min_acceptance_rate`, resolved (never None after construction)."""
        assert self.min_acceptance_rate is not None
        return self.min_acceptance_rate

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the JSON text of the CLI flag or the dict `LLM(...)` takes; unknown keys
        are errors. vLLM's `prompt_lookup_*` rule: one given alone sets the other."""
        if isinstance(value, SpeculativeConfig):
            return value
        required = ("method", "num_speculative_tokens")
        options = json_options(value, cls, "speculative_config", required)
        lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        if (lo is None) != (hi is None):
            options["prompt_lookup_min"] = options["prompt_lookup_max"] = lo if hi is None else hi
        try:
            return cls(**options)
        except TypeError as exc:  # a value of the wrong type in a comparison
            raise ConfigError(f"bad speculative_config: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """argparse `type=` of `--speculative-config`: a bad value is a usage error that
    names the problem."""
    try:
        return SpeculativeConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc

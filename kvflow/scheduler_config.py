"""The scheduler's options: the step's token budget, queue order and limits, the
admission hold, the per-step vision-encoder budget and grammar compile timeout.
One section of the engine configuration (kvflow/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvflow.errors import ConfigError


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = _opt(2048, "token budget of one engine step")
    max_num_seqs: int = _opt(256, "most requests running at once")
    long_prefill_token_threshold: int = _opt(
        0, "cap on prefill tokens one request may take in a step (0 = budget/ no cap)"
    )
    policy: Literal["fcfs", "priority"] = _opt("fcfs", "waiting-queue order")
    prefill_order: Literal["fcfs", "shortest"] = _opt(
        "fcfs",
        "order in which a step admits waiting prompts: fcfs (queue order) or shortest "
        "(fewest prompt tokens first; a request passed over 32 steps goes first)",
    )
    admission_hold: float = _opt(
        0.0, "seconds a waiting prompt may wait for due arrivals to prefill with; 0 = off"
    )
    async_scheduling: bool = _opt(
        False, "plan the next step while the worker runs the current one (2 steps in flight)"
    )
    max_waiting_requests: int | None = _opt(
        None,
        "most requests (samples) waiting for their first step; more are refused "
        "(HTTP 429 with Retry-After); default: no limit",
    )
    max_queue_delay: float | None = _opt(
        None,
        "seconds a request may wait for its first step, else it fails "
        "(HTTP 503); default: no limit",
    )
    max_num_encoder_input_tokens: int = _opt(
        0, "image features the vision encoder may compute per step (0: max_num_batched_tokens)"
    )
    encoder_cache_size: int = _opt(0, "image features the scheduler counts as cached (0: same)")
    grammar_compile_timeout: float = _opt(
        30.0, "seconds a guided request's grammar may take to compile before it fails"
    )
    grammar_jump_forward: bool = _opt(
        True,
        "append a guided request's grammar-forced tokens without a model step "
        "(exact: only where the grammar allows a single token)",
    )

    @property
    def max_steps_in_flight(self) -> int:
        return 2 if self.async_scheduling else 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be >= 1")
        counts = (self.long_prefill_token_threshold, self.max_num_encoder_input_tokens)
        if min(*counts, self.encoder_cache_size) < 0:
            raise ConfigError("token thresholds, budgets and cache sizes must be >= 0")
        if self.prefill_order == "shortest" and self.policy == "priority":
            # shortest-first would override the priorities the client asked for
            raise ConfigError("prefill_order shortest works with policy fcfs only")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ConfigError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_queue_delay is not None and not self.max_queue_delay > 0:
            raise ConfigError(f"max_queue_delay must be > 0 seconds, got {self.max_queue_delay}")
        if self.grammar_compile_timeout <= 0 or self.admission_hold < 0:
            raise ConfigError("grammar_compile_timeout must be > 0, admission_hold >= 0")

    @property
    def sheds_load(self) -> bool:
        """Whether a limit may refuse or fail requests for load (a server's concern)."""
        return self.max_waiting_requests is not None or self.max_queue_delay is not None

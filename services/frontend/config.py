"""The frontend's settings, with the model limits it validates requests against."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvflow.errors import ConfigError
from kvflow.services.frontend.reasoning import reasoning_parser

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_STORED_RESPONSES = 1024


def new_frontend_id() -> str:
    return f"frontend-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class FrontendConfig:
    """Everything `build_app` needs besides the engine client and the tokenizer.

    `max_model_len` and `vocab_size` are the model's (the same numbers the scheduler
    and workers use): prompts and max_tokens are checked against them before a request
    reaches the engine.
    """

    served_model_name: str
    max_model_len: int
    vocab_size: int
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token; None = open
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    frontend_id: str = field(default_factory=new_frontend_id)  # the detokenizer routes by it
    model_root: str = ""  # shown as `root` in /v1/models (the model's path)
    stats_timeout_s: float = 10.0  # no SchedulerStats for this long: unhealthy
    shutdown_grace_s: float = 5.0  # after SIGTERM, streams may run this long, then error
    engine_label: str = "0"  # `engine` label of request-level metrics
    # /v1/responses kept for previous_response_id and GET (LRU; 0: none; response_store.py)
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    reasoning_parser: str | None = None  # chat's think-tag split (reasoning.py); None: off

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.vocab_size < 1:
            raise ConfigError("max_model_len and vocab_size must be >= 1")
        if self.max_body_bytes < 1:
            raise ConfigError("max_body_bytes must be >= 1")
        if self.max_stored_responses < 0:
            raise ConfigError("max_stored_responses must be >= 0")
        reasoning_parser(self.reasoning_parser)  # an unknown name fails here, at start
        if "#" in self.frontend_id or not self.frontend_id:
            raise ConfigError("frontend_id must be non-empty and without '#'")

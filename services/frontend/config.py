"""The frontend's settings and the model facts it validates requests against."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.errors import InvalidRequestError

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def _new_frontend_id() -> str:
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
    frontend_id: str = field(default_factory=_new_frontend_id)  # the detokenizer routes by it
    model_root: str = ""  # shown as `root` in /v1/models (the model's path)
    stats_timeout_s: float = 10.0  # no SchedulerStats for this long: unhealthy
    shutdown_grace_s: float = 5.0  # after SIGTERM, streams may run this long, then error
    engine_label: str = "0"  # `engine` label of request-level metrics

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.vocab_size < 1:
            raise InvalidRequestError("max_model_len and vocab_size must be >= 1")
        if self.max_body_bytes < 1:
            raise InvalidRequestError("max_body_bytes must be >= 1")
        if "#" in self.frontend_id or not self.frontend_id:
            raise InvalidRequestError("frontend_id must be non-empty and without '#'")


def read_model_facts(model_dir: Path, max_model_len: int | None = None) -> tuple[int, int]:
    """(max_model_len, vocab_size) from an HF config.json, capped by `max_model_len`."""
    hf_config = json.loads((model_dir / "config.json").read_text())
    text_config = hf_config.get("text_config", hf_config)
    model_len = int(text_config.get("max_position_embeddings") or 2048)
    vocab_size = int(text_config["vocab_size"])
    if max_model_len is not None:
        if max_model_len > model_len:
            raise InvalidRequestError(
                f"max_model_len {max_model_len} exceeds the model's context {model_len}"
            )
        model_len = max_model_len
    return model_len, vocab_size

"""The model's limits as served: context length and vocabulary, read once from config.json.

The one place that knows where they live (a multimodal config nests them under
`text_config`) and how `max_model_len` caps the context. The frontend, the offline
engine and the worker all call `read_model_limits`; the frontend (for its 4xx) and the
engine's admission (its own guard) both check prompts with `check_prompt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError, InvalidRequestError, PromptTooLongError

DEFAULT_CONTEXT_LEN = 2048  # a config without max_position_embeddings


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


def limits_from_config(config: dict[str, Any], max_model_len: int | None = None) -> ModelLimits:
    """Limits of an HF config dict, the context capped by `max_model_len`."""
    text_config = config.get("text_config", config)
    context = int(text_config.get("max_position_embeddings") or DEFAULT_CONTEXT_LEN)
    if max_model_len is not None:
        if max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > context:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's context {context}"
            )
        context = max_model_len
    return ModelLimits(max_model_len=context, vocab_size=int(text_config["vocab_size"]))


def read_model_limits(model_dir: Path, max_model_len: int | None = None) -> ModelLimits:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return limits_from_config(config, max_model_len)


def check_prompt(
    token_ids: list[int], max_tokens: int | None, max_model_len: int, vocab_size: int
) -> int:
    """Check a prompt's ids and length; returns max_tokens resolved to fit the context
    (None fills it). Raises InvalidRequestError / PromptTooLongError (HTTP 400)."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is out of vocabulary", param="prompt")
    room = max_model_len - len(token_ids)
    if room < 1:
        raise PromptTooLongError(
            f"the prompt has {len(token_ids)} tokens; this model's context is "
            f"{max_model_len} tokens and leaves no room to generate",
            param="prompt",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise PromptTooLongError(
            f"the prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"this model's context length of {max_model_len} tokens",
            param="max_tokens",
        )
    return max_tokens


def check_pooling_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """A pooling request's prompt: non-empty ids of the vocabulary, at most the context
    (nothing is generated, so a prompt may fill it). InvalidRequestError / PromptTooLongError."""
    if not token_ids:
        raise InvalidRequestError("the input is empty", param="input")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"input token id {bad} is out of vocabulary", param="input")
    if len(token_ids) > max_model_len:
        raise PromptTooLongError(
            f"the input has {len(token_ids)} tokens; this model's context is {max_model_len} "
            "tokens (set truncate_prompt_tokens to keep the last ones)",
            param="input",
        )

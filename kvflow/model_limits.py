"""The model's limits as served: context length and vocabulary, read once from config.json.

The one place that knows where they live (a multimodal config nests them under
`text_config`) and how `max_model_len` caps the context. The frontend, the offline
engine and the worker all call `read_model_limits`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError

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

"""kvflow: a fast LLM inference server with an OpenAI-compatible API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.pooling import PoolingParams
from kvflow.proto.lora import LoRARequest
from kvflow.sampling_params import SamplingParams
from kvflow.version import __version__

__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvflow.offline.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy: importing torch/transformers costs seconds; `kvflow.SamplingParams` should not.
    if name == "LLM":
        from kvflow.offline.llm import LLM

        return LLM
    raise AttributeError(name)

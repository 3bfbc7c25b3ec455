"""HF `architectures` name -> kvflow model class."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architectures: Sequence[str] | None) -> type[nn.Module]:
    """The class of the first supported entry of config.architectures."""
    for name in architectures or ():
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise UnsupportedModelError(
        f"unsupported model architecture {list(architectures or [])}; "
        f"kvflow supports {sorted(MODEL_CLASSES)}"
    )

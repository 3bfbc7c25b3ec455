"""Build a model from an HF directory (see model_files.py) with its weights loaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kvflow.errors import ConfigError
from kvflow.gpu_worker.model_files import set_offline

if TYPE_CHECKING:  # the models import torch layers and kernels: loaded when a model is
    from kvflow.gpu_worker.models.llama import LlamaForCausalLM

# A Llama config.json that states every field the model code reads needs no defaults,
# so it is read as plain JSON: importing transformers' config classes costs ~2.7 s of
# the worker's start-up. Anything else (other families, rope scaling, sliding windows,
# a missing field) goes through AutoConfig, which knows each family's defaults.
_EXPLICIT_LLAMA_FIELDS = (
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "vocab_size", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "hidden_act", "rope_parameters",
)  # fmt: skip


def is_explicit_llama_config(raw: dict[str, Any]) -> bool:
    rope = raw.get("rope_parameters")
    return (
        raw.get("model_type") == "llama"
        and all(key in raw for key in _EXPLICIT_LLAMA_FIELDS)
        and raw["hidden_act"] == "silu"
        and isinstance(rope, dict)
        and rope.get("rope_type", "default") == "default"
        and "rope_theta" in rope
        and not any(key in raw for key in ("rope_scaling", "sliding_window", "layer_types"))
    )


def load_hf_config(model_dir: Path) -> Any:
    """The model's config (attribute access, as transformers' config objects give it)."""
    raw = json.loads((model_dir / "config.json").read_text())
    if is_explicit_llama_config(raw):
        return SimpleNamespace(**raw)
    set_offline()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def text_config_of(config: Any) -> Any:
    """The language model's config: a vision-language config's `text_config`."""
    return getattr(config, "text_config", None) or config


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created directly in `dtype` (no float32 copy of a big model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    quantization: str = "none",
    load_format: str = "auto",
) -> LlamaForCausalLM:
    """The model of `model_dir` on `device` in `dtype`, weights loaded, in eval mode;
    `quantization` as gpu_worker/quantization.py describes; `load_format` "dummy":
    random weights (gpu_worker/dummy_weights.py), no checkpoint read."""
    from kvflow.gpu_worker.attention.backend import get_attention_backend
    from kvflow.gpu_worker.block_weights import attach_block_weights
    from kvflow.gpu_worker.models.registry import get_model_class
    from kvflow.gpu_worker.quantization import quantize_model
    from kvflow.gpu_worker.weight_packing import pack_weights
    from kvflow.gpu_worker.weights import iterate_safetensors, load_weights

    config = load_hf_config(model_dir)
    model_class = get_model_class(getattr(config, "architectures", None))
    backend = get_attention_backend(attention_backend)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config, backend)
    if load_format not in ("auto", "dummy"):
        raise ConfigError(f"load_format must be auto or dummy, got {load_format!r}")
    if load_format == "dummy":
        from kvflow.gpu_worker.dummy_weights import init_dummy_weights

        init_dummy_weights(model)
    else:
        load_weights(model, iterate_safetensors(model_dir))
        attach_block_weights(model, model_dir)  # a converted GGUF's blocks, for small batches
    quantize_model(model, quantization)
    pack_weights(model)  # CPU: oneDNN's layout, once (the plain weights are freed)
    return model.eval().requires_grad_(False)

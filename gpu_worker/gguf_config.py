"""A GGUF file's metadata as Hugging Face config fields (config.json of the converted model).

The keys every llama.cpp architecture shares (CONFIG_KEYS, under the `<arch>.` prefix),
the tokenizer's special token ids, RoPE (base and scaling) and tied embeddings (no
`output` tensor) are read here; an architecture's own fields come from its row in
gguf_archs.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.gguf_archs import GGUFArch
from kvflow.gpu_worker.gguf_metadata import Metadata
from kvflow.gpu_worker.gguf_rope import ROPE_FREQS, llama3_rope

# GGUF metadata key (after "<arch>.") -> HF config field.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}

TOKEN_ID_KEYS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}


def rope_parameters(md: Metadata, head_dim: int) -> dict[str, Any]:
    """HF rope_parameters from `<arch>.rope.*` (llama.cpp's default base is 10000), or
    Llama 3.1's schedule from its `rope_freqs` tensor (gguf_rope.py)."""
    theta = float(md.get("rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = md.get("rope.scaling.type", "none")
    if ROPE_FREQS in md.tensor_names:
        if kind != "none":
            raise UnsupportedModelError(f"GGUF {ROPE_FREQS} with rope scaling {kind!r}")
        rotary = int(md.get("rope.dimension_count", head_dim))
        return llama3_rope(md.tensor_values(ROPE_FREQS).astype(np.float64), rotary, theta)
    if kind == "none":
        return params
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    params["rope_type"] = kind
    params["factor"] = float(md.get("rope.scaling.factor", 1.0))
    original = md.get("rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def config_kwargs(md: Metadata, arch: GGUFArch) -> dict[str, Any]:
    """HF config fields read from the GGUF metadata (model_type and architectures included)."""
    kwargs: dict[str, Any] = {"model_type": arch.model_type, "architectures": [arch.hf_class]}
    for key, hf_key in CONFIG_KEYS.items():
        value = md.get(key)
        if isinstance(value, list):
            raise UnsupportedModelError(f"per-layer GGUF metadata {md.arch}.{key} is not supported")
        if value is not None:
            kwargs[hf_key] = value
    kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
    if "head_dim" not in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if "vocab_size" not in kwargs:
        kwargs["vocab_size"] = len(md.reader.fields["tokenizer.ggml.tokens"].data)
    for hf_key, gguf_key in TOKEN_ID_KEYS.items():
        value = md.field(f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            kwargs[hf_key] = int(value)
    kwargs["rope_parameters"] = rope_parameters(md, kwargs["head_dim"])
    kwargs["tie_word_embeddings"] = "output.weight" not in md.tensor_names
    kwargs["dtype"] = "float32"
    if arch.config is not None:
        kwargs.update(arch.config(md, kwargs))
    return kwargs

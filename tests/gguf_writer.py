"""Write a GGUF from a Hugging Face checkpoint the way llama.cpp's convert_hf_to_gguf does.

Tensor names come from the gguf package's own table (`gguf.get_tensor_name_map`, which
is llama.cpp's), never from kvflow's converter, so a wrong row in
gpu_worker/gguf_archs.py fails the tests. The conventions, each a step of llama.cpp's
converter:

- Q/K rows permuted for the archs whose RoPE pairs adjacent dims (PERMUTED);
- Gemma's norm weights stored as 1 + w;
- each layer's experts stacked as [n_expert, rows, cols] under ffn_{gate,up,down}_exps;
- Qwen2-MoE's shared-expert gate [1, n_embd] stored as [n_embd];
- Llama 3.1's RoPE schedule as its result, a divisor per frequency (rope_freqs);
- Phi-3's LongRoPE factors as tensors rope_factors_long / rope_factors_short;
- the metadata keys of each architecture (`_arch_metadata`).

Matrices whose columns fill whole blocks of 32 are quantized to `fmt`; `roundtrip`
gives the float values such a file encodes, for the safetensors twin.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

PERMUTED = {"llama", "granite", "smollm3"}  # llama.cpp's "normal" RoPE
NORM_SHIFTED = {"gemma2", "gemma3"}
VECTORS = ("shared_expert_gate.weight",)  # HF [1, n], llama.cpp [n] (Qwen2-MoE)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")


def quantizable(name: str, array: np.ndarray) -> bool:
    """Whether write_gguf quantizes this HF tensor (a matrix of whole blocks)."""
    return (
        not name.endswith(VECTORS)
        and array.ndim >= 2
        and array.shape[-1] % 32 == 0
        and "norm" not in name
    )


def roundtrip(array: np.ndarray, fmt: str) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[fmt]
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape)


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved rotary halves per head)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors -> one [E, rows, cols] tensor per layer and projection, named
    as llama.cpp's converter names the merged tensor before mapping it."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = array
            continue
        layer, block, expert, proj = match.groups()
        merged = f"model.layers.{layer}.{block}.experts.{proj}.weight"
        experts.setdefault(merged, {})[int(expert)] = array
    for merged, by_expert in experts.items():
        out[merged] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _rope_theta(config: Any) -> float:
    params = config.rope_parameters
    return float(params.get("full_attention", params)["rope_theta"])


def llama3_rope_freqs(config: Any) -> np.ndarray:
    """llama.cpp's rope_freqs of a llama3 schedule: per rotary frequency, 1 (short
    wavelength), factor (long) or the ramp's 1 / ((1 - s) / factor + s)."""
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _arch_metadata(writer: gguf.GGUFWriter, arch: str, config: Any) -> None:
    get = config.__dict__.get
    if arch in PERMUTED and config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    if get("num_experts") or get("num_local_experts"):
        writer.add_expert_count(get("num_experts") or get("num_local_experts"))
        writer.add_expert_used_count(config.num_experts_per_tok)
    if get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if (arch in NORM_SHIFTED or arch == "phi3") and get("sliding_window"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma3":
        full = config.rope_parameters["full_attention"]
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        rope = config.rope_parameters
        rotary = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
        writer.add_rope_dimension_count(rotary // config.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)


def _common_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_vocab_size(config.vocab_size)


def _llama_cpp_tensor(arch: str, config: Any, name: str, array: np.ndarray) -> np.ndarray:
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        array = permute(array, heads)
    if arch in NORM_SHIFTED and name.endswith("norm.weight"):
        array = array + np.float32(1.0)
    if name.endswith(VECTORS):
        array = array.reshape(-1)
    return np.ascontiguousarray(array, dtype=np.float32)


def write_gguf(
    path: Path,
    arch: str,
    config: Any,
    tensors: dict[str, np.ndarray],  # the HF checkpoint's (per-expert names)
    fmt: str | dict[str, str] = "F32",  # one format, or HF name -> format (default F32)
    tokenizer_from: Path | None = None,  # a GGUF whose tokenizer.* fields are copied
) -> None:
    writer = gguf.GGUFWriter(path, arch)
    _common_metadata(writer, config)
    _arch_metadata(writer, arch, config)
    if tokenizer_from is not None:
        for key, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                value_type = field.types[0]
                sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    else:
        writer.add_eos_token_id(3)
    names = gguf.get_tensor_name_map(
        getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers
    )
    for name, array in _stack_experts(tensors).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"llama.cpp has no name for {name} in {arch}"
        array = _llama_cpp_tensor(arch, config, name, array)
        tensor_fmt = fmt if isinstance(fmt, str) else fmt.get(name, "F32")
        if tensor_fmt != "F32" and quantizable(name, array):
            qtype = gguf.GGMLQuantizationType[tensor_fmt]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

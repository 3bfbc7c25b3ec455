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
- DeepSeek's kv_b_proj split into k_b (transposed per head) and v_b, as newer files do
  (`split_kv_b`), its V3 score-correction bias as exp_probs_b.bias;
- gpt-oss's fused interleaved gate_up_proj split into gate and up, its stacked experts
  transposed back to [E, rows, cols] and written in MXFP4, the sinks as attn_sinks.weight;
- the metadata keys of each architecture (`_arch_metadata`).

Matrices whose columns fill whole blocks of 32 are quantized to `fmt`; `encoded`
gives the float values such a file encodes for an HF tensor, for the safetensors twin.
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
TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")  # gpt-oss: [E, cols, rows] in HF
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")


def quantizable(name: str, array: np.ndarray) -> bool:
    """Whether write_gguf quantizes this HF tensor (a matrix of whole blocks)."""
    return (
        not name.endswith(VECTORS)
        and not name.endswith("bias")
        and array.ndim >= 2
        and array.shape[-1] % 32 == 0
        and "norm" not in name
    )


def roundtrip(array: np.ndarray, fmt: str) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[fmt]
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape)


def tensor_format(arch: str, name: str, fmt: str) -> str:
    """llama.cpp writes gpt-oss's experts in MXFP4 whatever the other matrices are."""
    return "MXFP4" if arch == "gpt-oss" and ".experts." in name else fmt


def encoded(arch: str, name: str, array: np.ndarray, fmt: str) -> np.ndarray:
    """The float values the GGUF holds for the HF tensor `name` (quantized along the GGUF's
    rows, which for gpt-oss's stacked experts are HF's columns)."""
    fmt = tensor_format(arch, name, fmt)
    if arch == "gpt-oss" and name.endswith(TRANSPOSED):
        rows = array.swapaxes(-1, -2)
        if not quantizable(name, rows):
            return array
        return np.ascontiguousarray(roundtrip(rows, fmt).swapaxes(-1, -2))  # (safetensors)
    return roundtrip(array, fmt) if fmt != "F32" and quantizable(name, array) else array


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


def _gpt_oss_tensors(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    stem = name.rpartition(".")[0]
    if name.endswith("sinks"):
        return {f"{name}.weight": array}
    if name.endswith("gate_up_proj"):  # [E, H, 2I], gate j at column 2j, up j at 2j + 1
        rows = array.swapaxes(1, 2)
        return {f"{stem}.gate_proj.weight": rows[:, ::2], f"{stem}.up_proj.weight": rows[:, 1::2]}
    if name.endswith("gate_up_proj_bias"):
        return {f"{stem}.gate_proj.bias": array[:, ::2], f"{stem}.up_proj.bias": array[:, 1::2]}
    if name.endswith("down_proj"):
        return {f"{name}.weight": array.swapaxes(1, 2)}
    if name.endswith("down_proj_bias"):
        return {f"{stem}.down_proj.bias": array}
    return {name: array}


def _deepseek2_tensors(
    config: Any, name: str, array: np.ndarray, split_kv_b: bool
) -> dict[str, np.ndarray]:
    if name.endswith("e_score_correction_bias"):
        return {name.replace("_bias", ".bias"): array}
    if split_kv_b and name.endswith("kv_b_proj.weight"):  # per head [k_b^T; v_b]
        nope = config.qk_nope_head_dim
        heads = array.reshape(config.num_attention_heads, nope + config.v_head_dim, -1)
        return {
            name.replace("kv_b_proj", "k_b_proj"): heads[:, :nope].swapaxes(1, 2),
            name.replace("kv_b_proj", "v_b_proj"): heads[:, nope:],
        }
    return {name: array}


def _llama_cpp_layout(
    arch: str, config: Any, tensors: dict[str, np.ndarray], split_kv_b: bool
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, array in _stack_experts(tensors).items():
        if arch == "gpt-oss":
            out.update(_gpt_oss_tensors(name, array))
        elif arch == "deepseek2":
            out.update(_deepseek2_tensors(config, name, array, split_kv_b))
        else:
            out[name] = array
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


def _yarn_metadata(writer: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if "mscale_all_dim" in rope:  # DeepSeek's
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek2_metadata(writer: gguf.GGUFWriter, config: Any, split_kv_b: bool) -> None:
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if split_kv_b:  # multi-query attention over the latent, the MLA sizes apart
        writer.add_head_count_kv(1)
        writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        writer.add_value_length(config.kv_lora_rank)
        writer.add_key_length_mla(qk_dim)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_head_count_kv(config.num_attention_heads)
        writer.add_key_length(qk_dim)
        writer.add_value_length(config.v_head_dim)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    v3 = config.model_type == "deepseek_v3"
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    writer.add_expert_gating_func(gating)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    if config.rope_parameters.get("rope_type") == "yarn":
        _yarn_metadata(writer, config.rope_parameters)


def _gpt_oss_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    if config.rope_parameters.get("rope_type") == "yarn":
        _yarn_metadata(writer, config.rope_parameters)


def _common_metadata(writer: gguf.GGUFWriter, arch: str, config: Any) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if arch != "deepseek2":  # (MLA's head sizes: _deepseek2_metadata)
        writer.add_head_count_kv(config.num_key_value_heads)
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
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
    split_kv_b: bool = False,  # DeepSeek: newer llama.cpp's attn_k_b + attn_v_b
) -> None:
    writer = gguf.GGUFWriter(path, arch)
    _common_metadata(writer, arch, config)
    _arch_metadata(writer, arch, config)
    if arch == "deepseek2":
        _deepseek2_metadata(writer, config, split_kv_b)
    if arch == "gpt-oss":
        _gpt_oss_metadata(writer, config)
    if tokenizer_from is not None:
        for key, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                value_type = field.types[0]
                sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    else:
        writer.add_eos_token_id(3)
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for name, array in _llama_cpp_layout(arch, config, tensors, split_kv_b).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"llama.cpp has no name for {name} in {arch}"
        array = _llama_cpp_tensor(arch, config, name, array)
        tensor_fmt = fmt if isinstance(fmt, str) else fmt.get(name, "F32")
        tensor_fmt = tensor_format(arch, name, tensor_fmt)
        if tensor_fmt != "F32" and quantizable(name, array):
            qtype = gguf.GGMLQuantizationType[tensor_fmt]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

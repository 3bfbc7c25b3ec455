"""The llama.cpp architectures kvflow reads from GGUF: one `GGUFArch` row each.

A row says what the converter (gguf_convert.py) needs to turn a file of that
architecture back into the Hugging Face directory one of kvflow's families loads:

    model_type, hf_class   the HF config written, and so the family (models/registry.py)
    block_tensors          GGUF tensor kind (blk.N.<kind>) -> HF module under model.layers.N
    permuted_qk            llama.cpp's "normal" RoPE rotates adjacent dims, HF's rotate-half
                           dims d and d + D/2, so llama.cpp's converter permuted the Q/K rows
                           of these architectures; we undo it
    norm_shift             Gemma's norms scale by (1 + w); llama.cpp stores 1 + w
    experts                the HF names of a mixture-of-experts layer; llama.cpp stacks the
                           experts as ffn_{gate,up,down}_exps [n_expert, rows, cols]
    row_vectors            1-D GGUF tensors HF holds as [1, n] (Qwen2-MoE's shared-expert gate)
    config_tensors         tensors that are metadata to HF (Phi-3's LongRoPE factors)
    hooks                  GGUF tensors that make one HF tensor of another name or layout
                           (gguf_joins.py: DeepSeek's split kv_b, gpt-oss's fused experts)
    config                 (metadata, common fields) -> the architecture's own HF config fields

One llama.cpp architecture can stand for two HF ones (VARIANTS): Mixtral is `llama` with
experts, DeepSeek-V3 is `deepseek2` with sigmoid routing. Adding an architecture is a row here plus a row in the test table
of tests/models/test_gguf_families.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.gguf_joins import TensorHook, interleaved, kv_b_joined, same, transposed
from kvflow.gpu_worker.gguf_metadata import Metadata

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LLAMA_BLOCKS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_BLOCKS = {
    **LLAMA_BLOCKS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
OLMO2_BLOCKS = {
    **{k: v for k, v in LLAMA_BLOCKS.items() if k not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
PHI3_BLOCKS = {**LLAMA_BLOCKS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
QWEN_MOE_BLOCKS = {**LLAMA_BLOCKS, "ffn_gate_inp": "mlp.gate"}
QWEN2_MOE_BLOCKS = {
    **QWEN_MOE_BLOCKS,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
MIXTRAL_BLOCKS = {**LLAMA_BLOCKS, "ffn_gate_inp": "block_sparse_moe.gate"}
DEEPSEEK2_BLOCKS = {
    **{k: v for k, v in LLAMA_BLOCKS.items() if k not in ("attn_k", "attn_v")},
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
DEEPSEEK2_HOOKS = (
    TensorHook(("attn_k_b", "attn_v_b"), "weight", "self_attn.kv_b_proj.weight", kv_b_joined),
    TensorHook(("exp_probs_b",), "bias", "mlp.gate.e_score_correction_bias", same),
)
GPT_OSS_BLOCKS = {
    **{k: v for k, v in LLAMA_BLOCKS.items() if not k.startswith("ffn")},
    "post_attention_norm": "post_attention_layernorm",  # the pre-MLP norm
    "ffn_gate_inp": "mlp.router",
}
GPT_OSS_HOOKS = (
    TensorHook(("attn_sinks",), "weight", "self_attn.sinks", same),
    *(
        TensorHook(
            ("ffn_gate_exps", "ffn_up_exps"), suffix, f"mlp.experts.gate_up_proj{hf}", interleaved
        )
        for suffix, hf in (("weight", ""), ("bias", "_bias"))
    ),
    TensorHook(("ffn_down_exps",), "weight", "mlp.experts.down_proj", transposed),
    TensorHook(("ffn_down_exps",), "bias", "mlp.experts.down_proj_bias", same),
)

# Where llama.cpp fixes a Gemma's attention scale by model size (its 27B uses
# hidden / heads, the others head_dim): the block count that identifies that size.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class ExpertNames:
    """HF names of layer N's experts: model.layers.N.<block>.experts.<e>.<gate|up|down>."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


ConfigHook = Callable[[Metadata, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class GGUFArch:
    model_type: str
    hf_class: str
    block_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_BLOCKS)
    permuted_qk: bool = False
    norm_shift: float = 0.0
    experts: ExpertNames | None = None
    row_vectors: tuple[str, ...] = ()
    config_tensors: tuple[str, ...] = ()
    hooks: tuple[TensorHook, ...] = ()
    config: ConfigHook | None = None


def _qwen_moe(md: Metadata, norm_topk_prob: bool) -> dict[str, Any]:
    # llama.cpp fixes the top-k renormalization per architecture (on for Qwen3-MoE, off
    # for Qwen2-MoE); a layer without a router is a dense MLP.
    sparse = set(md.layers_with("ffn_gate_inp"))
    return dict(
        num_experts=int(md.get("expert_count")),
        num_experts_per_tok=int(md.get("expert_used_count")),
        moe_intermediate_size=int(md.get("expert_feed_forward_length")),
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(md.block_count()) if i not in sparse],
    )


def _qwen3_moe(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return _qwen_moe(md, norm_topk_prob=True)


def _qwen2_moe(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    shared = int(md.get("expert_shared_feed_forward_length"))
    return {**_qwen_moe(md, norm_topk_prob=False), "shared_expert_intermediate_size": shared}


def _mixtral(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    width = md.get("expert_feed_forward_length", base["intermediate_size"])
    return dict(
        num_local_experts=int(md.get("expert_count")),
        num_experts_per_tok=int(md.get("expert_used_count")),
        intermediate_size=int(width),
        sliding_window=None,
    )


def _layer_types(md: Metadata, window: int | None, pattern: int) -> list[str]:
    """llama.cpp's fixed sliding-window pattern: of every `pattern` layers the last is
    global (Gemma 2: 2, Gemma 3: 6); no window stored, every layer is global."""
    sliding = [bool(window) and i % pattern < pattern - 1 for i in range(md.block_count())]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma(md: Metadata, base: dict[str, Any], pattern: int) -> dict[str, Any]:
    big = md.block_count() == GEMMA_27B_LAYERS[md.arch]
    scalar = base["hidden_size"] // base["num_attention_heads"] if big else base["head_dim"]
    window = md.get("attention.sliding_window") or None
    return dict(
        query_pre_attn_scalar=scalar,
        sliding_window=window,
        layer_types=_layer_types(md, window, pattern),
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=md.get("attn_logit_softcapping"),
        final_logit_softcapping=md.get("final_logit_softcapping"),
    )


def _gemma2(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return _gemma(md, base, pattern=2)


def _gemma3(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # Local layers rotate with their own base (10k unless stored) and no scaling.
    local = {"rope_type": "default", "rope_theta": float(md.get("rope.freq_base_swa", 10000.0))}
    ropes = {"full_attention": base["rope_parameters"], "sliding_attention": local}
    return {**_gemma(md, base, pattern=6), "rope_parameters": ropes}


def _phi3(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"sliding_window": md.get("attention.sliding_window") or None}
    rotary = md.get("rope.dimension_count")
    if rotary is not None and rotary != base["head_dim"]:
        out["partial_rotary_factor"] = rotary / base["head_dim"]  # Phi-4-mini
    if "rope_factors_long.weight" in md.tensor_names:  # LongRoPE
        original = int(md.get("rope.scaling.original_context_length"))
        out["original_max_position_embeddings"] = original
        out["rope_parameters"] = {
            **base["rope_parameters"],
            "rope_type": "longrope",
            "long_factor": md.tensor_values("rope_factors_long.weight").tolist(),
            "short_factor": md.tensor_values("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": original,
        }
    return out


def _granite(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp: no stored attention scale means head_dim ** -0.5, the others default to 1.
    return dict(
        attention_multiplier=float(md.get("attention.scale") or base["head_dim"] ** -0.5),
        embedding_multiplier=float(md.get("embedding_scale", 1.0)),
        residual_multiplier=float(md.get("residual_scale", 1.0)),
        logits_scaling=float(md.get("logit_scale", 1.0)),
    )


SMOLLM3_NO_ROPE_INTERVAL = 4  # llama.cpp: every 4th layer has no RoPE (not in the metadata)


def _smollm3(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    n = md.block_count()
    uses_rope = [int((i + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(n)]
    return dict(no_rope_layers=uses_rope, use_sliding_window=False, sliding_window=None)


SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax (V2), 2 sigmoid (V3)
YARN_LOG_MUL = 0.1  # llama.cpp stores DeepSeek's mscale_all_dim as 0.1 * it


def _deepseek_experts(md: Metadata) -> dict[str, Any]:
    return dict(
        n_routed_experts=int(md.get("expert_count")),
        num_experts_per_tok=int(md.get("expert_used_count")),
        moe_intermediate_size=int(md.get("expert_feed_forward_length")),
        n_shared_experts=int(md.get("expert_shared_count", 0)),
        first_k_dense_replace=int(md.get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(md.get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(md.get("expert_weights_norm", False)),
        n_group=int(md.get("expert_group_count", 1)),
        topk_group=int(md.get("expert_group_used_count", 1)),
    )


def _deepseek2(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # Files that split kv_b store the MLA head sizes apart (key_length is then the
    # latent's r + R, with one KV head); older ones only in key_length / value_length.
    key = int(md.get("attention.key_length_mla") or md.get("attention.key_length"))
    value = int(md.get("attention.value_length_mla") or md.get("attention.value_length"))
    rope = int(md.get("rope.dimension_count"))
    out = dict(
        num_key_value_heads=base["num_attention_heads"],
        head_dim=rope,  # the RoPE table's width
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key - rope,
        v_head_dim=value,
        q_lora_rank=md.get("attention.q_lora_rank"),
        kv_lora_rank=int(md.get("attention.kv_lora_rank")),
        **_deepseek_experts(md),
    )
    if md.get("expert_gating_func") != SIGMOID_GATING:  # V2's softmax routing
        out["topk_method"] = "group_limited_greedy" if out["n_group"] > 1 else "greedy"
    log_mul = md.get("rope.scaling.yarn_log_multiplier")
    if base["rope_parameters"]["rope_type"] == "yarn" and log_mul:
        # llama.cpp's DeepSeek YaRN takes mscale as 1 (DeepSeek's own value)
        mscales = {"mscale": 1.0, "mscale_all_dim": round(float(log_mul) / YARN_LOG_MUL, 6)}
        out["rope_parameters"] = {**base["rope_parameters"], **mscales}
    return out


def _gpt_oss(md: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    window = md.get("attention.sliding_window") or None
    rope = base["rope_parameters"]
    if rope["rope_type"] == "yarn":  # gpt-oss's YaRN keeps its correction range unrounded
        rope = {**rope, "truncate": False}
    return dict(
        num_local_experts=int(md.get("expert_count")),
        num_experts_per_tok=int(md.get("expert_used_count")),
        intermediate_size=int(md.get("expert_feed_forward_length")),
        sliding_window=window,
        layer_types=_layer_types(md, window, pattern=2),  # llama.cpp: even layers slide
        rope_parameters=rope,
        attention_bias=True,
    )


DEEPSEEK3 = GGUFArch(
    "deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK2_BLOCKS, experts=ExpertNames(),
    hooks=DEEPSEEK2_HOOKS, config=_deepseek2,
)  # fmt: skip
MIXTRAL = GGUFArch(
    "mixtral", "MixtralForCausalLM", MIXTRAL_BLOCKS, permuted_qk=True,
    experts=ExpertNames("block_sparse_moe", "w1", "w3", "w2"), config=_mixtral,
)  # fmt: skip

ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": GGUFArch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        QWEN2_MOE_BLOCKS,
        experts=ExpertNames(),
        row_vectors=("ffn_gate_inp_shexp",),
        config=_qwen2_moe,
    ),
    "qwen3moe": GGUFArch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        QWEN_MOE_BLOCKS,
        experts=ExpertNames(),
        config=_qwen3_moe,
    ),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", GEMMA_BLOCKS, norm_shift=1.0, config=_gemma2),
    "gemma3": GGUFArch(
        "gemma3_text", "Gemma3ForCausalLM", GEMMA_BLOCKS, norm_shift=1.0, config=_gemma3
    ),
    "phi3": GGUFArch(
        "phi3",
        "Phi3ForCausalLM",
        PHI3_BLOCKS,
        config=_phi3,
        config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
    ),
    "olmo2": GGUFArch("olmo2", "Olmo2ForCausalLM", OLMO2_BLOCKS),
    "granite": GGUFArch("granite", "GraniteForCausalLM", permuted_qk=True, config=_granite),
    "smollm3": GGUFArch("smollm3", "SmolLM3ForCausalLM", permuted_qk=True, config=_smollm3),
    "deepseek2": GGUFArch(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        DEEPSEEK2_BLOCKS,
        experts=ExpertNames(),
        hooks=DEEPSEEK2_HOOKS,
        config=_deepseek2,
    ),
    "gpt-oss": GGUFArch(
        "gpt_oss", "GptOssForCausalLM", GPT_OSS_BLOCKS, hooks=GPT_OSS_HOOKS, config=_gpt_oss
    ),
}


@dataclass(frozen=True)
class Variant:
    """A second HF architecture behind one llama.cpp architecture, told by the metadata."""

    arch: str  # llama.cpp's
    when: str  # in words (README's GGUF column)
    row: GGUFArch
    applies: Callable[[Metadata], bool]


VARIANTS = (
    Variant("llama", "with experts", MIXTRAL, lambda md: bool(md.get("expert_count", 0))),
    Variant(
        "deepseek2",
        "with sigmoid routing",
        DEEPSEEK3,
        lambda md: md.get("expert_gating_func") == SIGMOID_GATING,
    ),
)


def arch_of(md: Metadata) -> GGUFArch:
    """The row of the file's `general.architecture`, or of its variant (VARIANTS)."""
    if md.arch not in ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {md.arch!r} is not supported (supported: {sorted(ARCHS)})"
        )
    for variant in VARIANTS:
        if variant.arch == md.arch and variant.applies(md):
            return variant.row
    return ARCHS[md.arch]

"""Gemma 2 (Gemma2ForCausalLM): the shared decoder with Gemma's options.

Sandwich blocks (norms before and after attention and MLP) of (1 + w) RMSNorms, local
(sliding-window) and global layers by `layer_types`, attention logits soft-capped by
`attn_logit_softcapping` and scaled by query_pre_attn_scalar ** -0.5, final logits
soft-capped by `final_logit_softcapping`, embeddings scaled by sqrt(hidden_size), a
gelu_pytorch_tanh MLP and (usually) an LM head tied to the embedding.
"""

from __future__ import annotations

from typing import Any

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


def gemma_spec(config: Any, **overrides: Any) -> DecoderSpec:
    """The options every Gemma shares; `overrides` add a generation's own."""
    bias = bool(getattr(config, "attention_bias", False))
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    options: dict[str, Any] = dict(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=False,
        mlp_bias=False,
        sliding_windows=DecoderSpec.sliding_windows_of(config),
        block="sandwich",
        unit_offset_norms=True,
        activation=activation,
        attention_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        embedding_scale=config.hidden_size**0.5,
    )
    return DecoderSpec(**{**options, **overrides})


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return gemma_spec(config)

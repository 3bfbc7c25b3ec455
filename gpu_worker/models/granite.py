"""Granite (GraniteForCausalLM): the Llama decoder with four multipliers from the config:
embeddings times `embedding_multiplier`, each block's attention and MLP outputs times
`residual_multiplier` before they join the residual stream, attention scores scaled by
`attention_multiplier` (instead of head_dim ** -0.5) and logits divided by
`logits_scaling`."""

from __future__ import annotations

from typing import Any

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=DecoderSpec.sliding_windows_of(config),
            attention_scale=config.attention_multiplier,
            embedding_scale=config.embedding_multiplier,
            residual_scale=config.residual_multiplier,
            logits_divisor=config.logits_scaling,
        )

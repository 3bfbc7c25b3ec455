"""Granite (GraniteForCausalLM): the Llama decoder with four multipliers from the config:
embeddings times `embedding_multiplier`, each block's attention and MLP outputs times
`residual_multiplier` before they join the residual stream, attention scores scaled by
`attention_multiplier` (instead of head_dim ** -0.5) and logits divided by
`logits_scaling`."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return dataclasses.replace(
            super().decoder_spec(config),
            attention_scale=config.attention_multiplier,
            embedding_scale=config.embedding_multiplier,
            residual_scale=config.residual_multiplier,
            logits_divisor=config.logits_scaling,
        )

"""Gemma 3, text (Gemma3ForCausalLM): Gemma 2's decoder (gemma2.py) plus (1 + w)
RMSNorms on every q and k head, and one RoPE table per layer type: local layers rotate
with `rope_parameters["sliding_attention"]` (base 10k), global ones with
`rope_parameters["full_attention"]` (base 1M, possibly scaled). Soft-capping is off
unless the config sets it."""

from __future__ import annotations

from typing import Any

from kvflow.gpu_worker.layers.rope_scaling import rope_parameters
from kvflow.gpu_worker.models.gemma2 import gemma_spec
from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


def rope_tables_by_layer_type(config: Any) -> dict[str, dict[str, Any]]:
    """{layer type: rope dict}; a config with one flat rope dict uses it for every type."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(config.layer_types)
    if types <= set(params) and all(isinstance(params[t], dict) for t in types):
        theta = getattr(config, "rope_theta", 10000.0)
        return {t: {"rope_theta": theta, **params[t]} for t in types}
    return {t: rope_parameters(config) for t in types}


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return gemma_spec(
            config,
            qk_norm=True,
            ropes=rope_tables_by_layer_type(config),
            rope_layers=tuple(config.layer_types),
        )

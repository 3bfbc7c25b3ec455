"""Qwen2/2.5 and Qwen3: the Llama decoder with q/k/v biases (Qwen2) or per-head q/k norms
(Qwen3)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on q/k/v (not on o_proj)."""

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=True,
            o_bias=False,
            qk_norm=False,
            mlp_bias=False,
            sliding_windows=DecoderSpec.sliding_windows_of(config),
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with an RMSNorm over head_dim on every q and k head (before RoPE)."""

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return dataclasses.replace(super().decoder_spec(config), qk_norm=True, mlp_bias=False)

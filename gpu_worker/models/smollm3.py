"""SmolLM3 (SmolLM3ForCausalLM): the Llama decoder with NoPE layers: `no_rope_layers[i]`
is 1 where layer i rotates q and k and 0 where it uses no position embedding at all
(every fourth layer in the released models). Sliding windows follow `layer_types` when
`use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DEFAULT_ROPE, DecoderSpec


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        uses_rope = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        return DecoderSpec(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=DecoderSpec.sliding_windows_of(config),
            rope_layers=tuple(DEFAULT_ROPE if use else None for use in uses_rope),
        )

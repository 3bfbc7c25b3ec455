"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norm), and a mixture of
experts in every `decoder_sparse_step`-th layer outside `mlp_only_layers` (the others
keep a dense MLP of `intermediate_size`). Experts are `moe_intermediate_size` wide;
`norm_topk_prob` rescales the top-k routing weights to sum to 1."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn

from kvflow.gpu_worker.layers.moe import ExpertNames, FusedMoE
from kvflow.gpu_worker.models.moe_base import (
    MoeForCausalLM,
    dense_mlp,
    experts_prefix,
    is_sparse_layer,
)
from kvflow.gpu_worker.models.qwen import Qwen3ForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


def qwen_moe_mlp(config: Any, layer: int, spec: DecoderSpec) -> nn.Module:
    if not is_sparse_layer(config, layer):
        return dense_mlp(config, spec, config.intermediate_size)
    return FusedMoE(
        config.num_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        names=ExpertNames(experts_prefix(layer)),
    )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        spec = Qwen3ForCausalLM.decoder_spec(config)
        return dataclasses.replace(spec, mlp=functools.partial(qwen_moe_mlp, spec=spec))

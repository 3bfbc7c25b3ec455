"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (q/k/v biases), and in its sparse
layers (Qwen's rule, moe_base.is_sparse_layer) the routed experts plus one shared
expert that every token goes through, scaled per token by sigmoid(shared_expert_gate):

    out = moe(x) + sigmoid(x w_g^T) * shared_expert(x)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.layers.moe import ExpertNames, FusedMoE, Router
from kvflow.gpu_worker.models.moe_base import (
    MoeForCausalLM,
    dense_mlp,
    experts_prefix,
    is_sparse_layer,
)
from kvflow.gpu_worker.models.spec import DecoderSpec


class Qwen2MoeBlock(FusedMoE):
    def __init__(self, config: Any, layer: int, spec: DecoderSpec) -> None:
        super().__init__(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            names=ExpertNames(experts_prefix(layer)),
        )
        self.shared_expert = dense_mlp(config, spec, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Router(config.hidden_size, 1)  # [1, H], replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)  # summed over the ranks by its down_proj
        scale = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
        return super().forward(x) + scale * shared


def qwen2_moe_mlp(config: Any, layer: int, spec: DecoderSpec) -> nn.Module:
    if not is_sparse_layer(config, layer):
        return dense_mlp(config, spec, config.intermediate_size)
    return Qwen2MoeBlock(config, layer, spec)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        spec = DecoderSpec(
            qkv_bias=bool(getattr(config, "qkv_bias", True)),
            o_bias=False,
            qk_norm=False,
            mlp_bias=False,
            sliding_windows=DecoderSpec.sliding_windows_of(config),
        )
        return dataclasses.replace(spec, mlp=functools.partial(qwen2_moe_mlp, spec=spec))

"""Mixtral (MixtralForCausalLM): Mistral's decoder with a mixture of experts in every
layer. The checkpoint calls the block `block_sparse_moe` and an expert's projections
w1 (gate), w3 (up), w2 (down); the top-k routing weights always sum to 1."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from kvflow.gpu_worker.layers.moe import ExpertNames, FusedMoE
from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.moe_base import MoeForCausalLM, experts_prefix
from kvflow.gpu_worker.models.spec import DecoderSpec


def mixtral_moe(config: Any, layer: int) -> nn.Module:
    return FusedMoE(
        config.num_local_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.intermediate_size,
        renormalize=True,
        names=ExpertNames(experts_prefix(layer, "block_sparse_moe"), "w1", "w3", "w2"),
    )


class MixtralForCausalLM(MoeForCausalLM):
    moe_block = "block_sparse_moe"

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return dataclasses.replace(LlamaForCausalLM.decoder_spec(config), mlp=mixtral_moe)

"""OLMo 2 (Olmo2ForCausalLM): post-norm blocks (each sublayer reads the residual stream
and its output is normed before the add) and RMSNorms over the whole q and k
projections, before they are split into heads (split across tensor-parallel ranks:
layers/norm.py ShardedRMSNorm)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import DecoderSpec


class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        # Llama's spec, with post-norm blocks and q/k norms over the whole projections.
        return dataclasses.replace(
            super().decoder_spec(config), qk_norm_whole=True, mlp_bias=False, block="post"
        )

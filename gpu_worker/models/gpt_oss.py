"""gpt-oss (GptOssForCausalLM): the Llama decoder with

* attention sinks: a learned logit per head in every layer's softmax denominator
  (checkpoint `self_attn.sinks`, layers/attention.py), biases on q/k/v/o;
* sliding-window layers alternating with full ones (`layer_types`, `sliding_window`);
* YaRN RoPE (`rope_parameters`, with gpt-oss's `truncate: false`, rope_scaling.py);
* a mixture of experts in every layer (layers/moe.py's options): a router with a bias,
  softmax over the top-k logits only, experts with biases and the clamped SwiGLU
  (`swiglu_limit`, alpha 1.702) in place of silu(gate) * up.

The checkpoint stacks every expert in one tensor per projection, stored transposed and
with gate and up in alternate columns:

    experts.gate_up_proj       [E, H, 2I]   column 2j: gate j, column 2j + 1: up j
    experts.gate_up_proj_bias  [E, 2I]      the same interleaving
    experts.down_proj          [E, I, H]
    experts.down_proj_bias     [E, H]

`split_checkpoint_tensor` cuts each into the per-expert [I, H] / [H, I] pieces the fused
experts load (gate rows, then up rows), named `<tensor>[<expert>].<gate|up>` so that a
missing or misshapen tensor is reported by its checkpoint name. MXFP4 checkpoints (the
published ones: `_blocks` + `_scales` pairs) are dequantized to the model dtype as they
are read (gpu_worker/mxfp4.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.layers.moe import ExpertNames, FusedMoE
from kvflow.gpu_worker.models.moe_base import MoeForCausalLM, experts_prefix
from kvflow.gpu_worker.models.spec import DecoderSpec
from kvflow.kernels.fused_moe_reference import ClampedSwiGLU

SWIGLU_ALPHA = 1.702  # fixed in gpt-oss (transformers' GptOssConfig.swiglu_alpha)
_STACKED = ("gate_up_proj", "down_proj")


class StackedExpertNames(ExpertNames):
    """Expert e's piece of a stacked checkpoint tensor: `<prefix>.gate_up_proj[e].gate`,
    `...gate_up_proj[e].up`, `<prefix>.down_proj[e]`; biases under `<tensor>_bias`."""

    def of(self, expert: int, proj: str) -> str:
        tensor, _, part = proj.partition(".")
        return f"{self.prefix}.{tensor}[{expert}]" + (f".{part}" if part else "")

    def bias_of(self, expert: int, proj: str) -> str:
        tensor, _, part = proj.partition(".")
        return self.of(expert, f"{tensor}_bias" + (f".{part}" if part else ""))


def gpt_oss_moe(config: Any, layer: int) -> nn.Module:
    names = StackedExpertNames(
        experts_prefix(layer), "gate_up_proj.gate", "gate_up_proj.up", "down_proj"
    )
    return FusedMoE(
        config.num_local_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.intermediate_size,
        renormalize=False,
        names=names,
        router_bias=True,
        topk_softmax=True,
        expert_bias=True,
        clamped=ClampedSwiGLU(SWIGLU_ALPHA, float(getattr(config, "swiglu_limit", 7.0))),
    )


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, config: Any, backend: Any) -> None:
        super().__init__(config, backend)
        from kvflow.gpu_worker.mxfp4 import Mxfp4Pairs, check_quantization

        check_quantization(config)
        self._mxfp4 = Mxfp4Pairs()  # halves of MXFP4 tensors waiting for their partner
        self._dtype = torch.get_default_dtype()  # the model's (built under it): dequantize to it

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", True))
        return DecoderSpec(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            mlp_bias=False,
            sliding_windows=DecoderSpec.sliding_windows_of(config),
            attn_sinks=True,
            mlp=gpt_oss_moe,
        )

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """The sinks live in the attention layer, the router is our MoE's `gate`."""
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        return super().checkpoint_target(name.replace(".mlp.router.", ".mlp.gate."))

    def split_checkpoint_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stacked expert tensors -> per-expert pieces (module docstring); an MXFP4 pair
        -> its dequantized tensor, once both halves were read."""
        if ".mlp.experts." not in name:
            yield name, tensor
            return
        for whole, values in self._mxfp4.take(name, tensor, self._dtype):
            yield from self._expert_pieces(whole, values)

    def _expert_pieces(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        prefix, _, kind = name.rpartition(".")
        config = self.config
        experts, hidden, inter = (
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
        )
        shapes = {
            "gate_up_proj": (experts, hidden, 2 * inter),
            "gate_up_proj_bias": (experts, 2 * inter),
            "down_proj": (experts, inter, hidden),
            "down_proj_bias": (experts, hidden),
        }
        if kind not in shapes:
            raise UnsupportedModelError(f"checkpoint tensor {name!r} matches no model parameter")
        if tuple(tensor.shape) != shapes[kind]:
            raise UnsupportedModelError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {shapes[kind]}"
            )
        for e in range(experts):
            piece = f"{prefix}.{kind}[{e}]"
            if kind.startswith("gate_up_proj"):  # gate, up in alternate (last-dim) columns
                yield f"{piece}.gate", tensor[e, ..., 0::2].transpose(0, -1)
                yield f"{piece}.up", tensor[e, ..., 1::2].transpose(0, -1)
            else:
                yield piece, tensor[e].transpose(0, -1)  # [I, H] -> [H, I]; a bias stays

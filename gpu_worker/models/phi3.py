"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): the Llama decoder, loaded from checkpoints
that store q|k|v fused as `qkv_proj` and gate|up as `gate_up_proj`, rotated by LongRoPE
(`rope_scaling` type "longrope"/"su": short and long factors, rope_scaling.py) and, in
Phi-4-mini, over a partial rotary dim (`partial_rotary_factor`). A `sliding_window` in
the config applies to every layer, as in transformers."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.spec import head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def split_checkpoint_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A fused checkpoint matrix (weight or bias) as the separate ones the packed
        layers load (weights.py): qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj."""
        config = self.config
        if ".self_attn.qkv_proj." in name:
            q = config.num_attention_heads * head_dim_of(config)
            kv = config.num_key_value_heads * head_dim_of(config)
            if tensor.shape[0] != q + 2 * kv:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {q + 2 * kv}")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                yield name.replace(".qkv_proj.", f".{part}."), rows
        elif ".mlp.gate_up_proj." in name:
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor

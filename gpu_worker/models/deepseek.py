"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): the Llama
decoder with multi-head latent attention and DeepSeek's mixture of experts.

Attention (MLA). Per token, the query comes from the hidden state directly (`q_proj`,
V2-Lite: q_lora_rank None) or through a low-rank bottleneck (`q_a_proj` -> RMSNorm ->
`q_b_proj`), and splits per head into q_nope (N = qk_nope_head_dim) and q_pe (R =
qk_rope_head_dim). Keys and values come from one compressed row:

    kv_a_proj_with_mqa(x) = [ c (r = kv_lora_rank) | k_pe (R) ]   c normed, k_pe rotated

which is all the KV cache keeps (layers/mla.py, attention/mla_torch.py): r + R values a
token and layer (576 for V3) instead of the 2 H (N + R) of full K/V heads.

RoPE touches only q_pe and k_pe. DeepSeek lays their dims out in interleaved pairs (V2
always, V3 with `rope_interleave`); they are de-interleaved before the rotation, which
permutes the rope dims of q and k alike and so leaves every q.k unchanged. With YaRN the
softmax scale grows by mscale(factor, mscale_all_dim)^2 (rope_scaling.softmax_mscale).

MLP. The first `first_k_dense_replace` layers are dense; the others route to
`n_routed_experts` (layers/moe.py with DeepSeek's grouped top-k: V2 softmax, V3 sigmoid
+ e_score_correction_bias; weights times routed_scaling_factor) plus `n_shared_experts`
always-on experts, one MLP of n_shared_experts * moe_intermediate_size. V2's
`norm_topk_prob` renormalizes the top-k weights as DeepSeek's own code does (every V2
checkpoint sets it false; transformers ignores it for V2).

A checkpoint's multi-token-prediction layers (V3's `model.layers.61.*`) are not run and
not loaded (layers past num_hidden_layers are skipped as another stage's).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kvflow.gpu_worker.layers.mla import LatentUpProjection, MLAAttention
from kvflow.gpu_worker.layers.moe import ExpertNames, FusedMoE
from kvflow.gpu_worker.layers.norm import RMSNorm
from kvflow.gpu_worker.layers.rope_scaling import rope_parameters, softmax_mscale
from kvflow.gpu_worker.layers.rotary import Rope, apply_rotary_qk
from kvflow.gpu_worker.models.moe_base import MoeForCausalLM, dense_mlp, experts_prefix
from kvflow.gpu_worker.models.spec import DEFAULT_ROPE, DecoderSpec, head_dim_of
from kvflow.kernels.fused_moe_reference import GroupedTopK

_LOW_RANK_EPS = 1e-6  # the q_a / kv_a norms' epsilon (not the config's rms_norm_eps)


class DeepseekAttention(nn.Module):
    def __init__(
        self, config: Any, layer: int, backend: AttentionBackend, interleaved: bool
    ) -> None:
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.interleaved = config.kv_lora_rank, interleaved
        qk_dim, v_dim = self.nope + self.rope_dim, config.v_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LOW_RANK_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, [heads * qk_dim], False)
        else:
            self.q_proj = ColumnParallelLinear(hidden, [heads * qk_dim], bias=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LOW_RANK_EPS)
        self.kv_b_proj = LatentUpProjection(self.rank, heads, self.nope + v_dim)
        self.o_proj = RowParallelLinear(heads * v_dim, hidden, bias=bias)
        self.num_heads = self.kv_b_proj.num_heads  # this rank's
        scale = qk_dim**-0.5 * softmax_mscale(rope_parameters(config))
        self.attn = MLAAttention(self.num_heads, self.rank + self.rope_dim, scale, backend)

    def forward(
        self, hidden: torch.Tensor, ropes: dict[str, Rope], rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size], or [len(rows), hidden_size]:
        every token's latent is cached, the output projected only for `rows`."""
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(q.shape[0], self.num_heads, -1).split(
            [self.nope, self.rope_dim], dim=-1
        )
        compressed = self.kv_a_proj_with_mqa(hidden)  # [T, r + R]
        c_kv = self.kv_a_layernorm(compressed[:, : self.rank].contiguous())
        k_pe = compressed[:, None, self.rank :]  # [T, 1, R]
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        q_pe, k_pe = apply_rotary_qk(q_pe, k_pe, ropes[DEFAULT_ROPE])
        latent = torch.cat((c_kv[:, None], k_pe), dim=-1)  # [T, 1, r + R]
        out = self.attn(q_nope, q_pe, latent, self.kv_b_proj.per_head())  # [T, H * V]
        if rows is not None:
            out = out[rows]
        return self.o_proj(out)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] pairs (x0, x1), (x2, x3) ... -> [x0, x2, ... | x1, x3, ...], so that the
    rotate-half RoPE turns each pair as DeepSeek's interleaved RoPE does."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekMoE(FusedMoE):
    """The routed experts plus the shared ones every token goes through."""

    def __init__(self, config: Any, layer: int, spec: DecoderSpec, grouped: GroupedTopK):
        super().__init__(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            names=ExpertNames(experts_prefix(layer)),
            grouped=grouped,
        )
        shared = (getattr(config, "n_shared_experts", None) or 0) * config.moe_intermediate_size
        self.shared_experts = dense_mlp(config, spec, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


def deepseek_mlp(config: Any, layer: int, spec: DecoderSpec, grouped: GroupedTopK) -> nn.Module:
    if layer < (getattr(config, "first_k_dense_replace", 0) or 0):
        return dense_mlp(config, spec, config.intermediate_size)
    return DeepseekMoE(config, layer, spec, grouped)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        if head_dim_of(config) != config.qk_rope_head_dim:  # the RoPE table's width
            raise UnsupportedModelError(
                f"DeepSeek config with head_dim {head_dim_of(config)}, expected "
                f"qk_rope_head_dim {config.qk_rope_head_dim}"
            )
        super().__init__(config, backend)

    @classmethod
    def routing(cls, config: Any) -> GroupedTopK:
        """V2: softmax scores; groups scored by their best expert when the config's
        topk_method is group_limited_greedy, plain top-k ("greedy") otherwise."""
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        return GroupedTopK(
            scoring="softmax",
            group_score="max",
            num_groups=config.n_group if grouped else 1,
            topk_groups=config.topk_group if grouped else 1,
            scaling=float(config.routed_scaling_factor),
        )

    @classmethod
    def interleaved_rope(cls, config: Any) -> bool:
        return True

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        spec = DecoderSpec(
            qkv_bias=False,
            o_bias=False,
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=(None,) * config.num_hidden_layers,
        )
        attention = functools.partial(DeepseekAttention, interleaved=cls.interleaved_rope(config))
        mlp = functools.partial(deepseek_mlp, spec=spec, grouped=cls.routing(config))
        return dataclasses.replace(spec, attention=attention, mlp=mlp)

    def attention_layers(self) -> list[Any]:  # the latent attention layers
        return [m for m in self.modules() if isinstance(m, MLAAttention)]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def routing(cls, config: Any) -> GroupedTopK:
        """V3: sigmoid scores (+ the correction bias for the choice), groups scored by
        the sum of their two best experts; `n_group` groups, always."""
        return GroupedTopK(
            scoring="sigmoid",
            group_score="top2",
            num_groups=config.n_group or 1,
            topk_groups=config.topk_group or 1,
            scaling=float(config.routed_scaling_factor),
        )

    @classmethod
    def interleaved_rope(cls, config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))

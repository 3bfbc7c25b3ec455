"""The dense decoder every family runs, and its Llama members: Llama 2/3, SmolLM2,
Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm). The other families (gemma2.py, phi3.py,
olmo2.py, granite.py, smollm3.py, ...) are this decoder with another `DecoderSpec`
(spec.py: block style, norms, RoPE per layer, soft-caps, multipliers).

Tokens of all requests of a step are flattened into one dimension (no batch dim):

    input_ids [T] -> embed -> N x (attn-norm, attention, mlp-norm, MLP) -> norm -> [T, hidden]

Pre-norm blocks keep the residual stream separate and fuse its add into the next norm
(`RMSNorm.add_and_norm`). Logits are computed only for the rows the sampler needs
(`compute_logits`), never for every prompt token by default; given those rows
(`output_rows`), the last layer also projects and runs its MLP for them alone, since
nothing else reads its output (every token's K/V is stored before that point).

Pipeline parallelism: a model built inside `pipeline_parallel(stage)` holds only that
stage's layers (the others are `StageMissing` placeholders, so parameter names keep
their global layer index and checkpoint names match), the embedding on the first stage
and the final norm + LM head on the last (which also holds the embedding when the head
is tied to it). A stage before the last returns (hidden, residual) for the next one.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.layers.activation import gated_activation
from kvflow.gpu_worker.layers.attention import Attention
from kvflow.gpu_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.gpu_worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvflow.gpu_worker.layers.norm import RMSNorm, ShardedRMSNorm
from kvflow.gpu_worker.layers.rotary import Rope, RotaryEmbedding, apply_rotary_qk
from kvflow.gpu_worker.models.spec import DEFAULT_ROPE, DecoderSpec, head_dim_of
from kvflow.gpu_worker.parallel_state import get_pp_group, get_tp_group

__all__ = [  # DecoderSpec moved to spec.py; importers of it from here keep working
    "DecoderSpec", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP",
    "LlamaModel", "MistralForCausalLM",
    "StageMissing", "lm_head_cost",
]  # fmt: skip

Activations = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) between stages


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, layer: int, backend: AttentionBackend):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=spec.qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=spec.o_bias
        )
        self.q_norm, self.k_norm = _qk_norms(config, spec, self.qkv_proj)
        self.rope = spec.rope_of_layer(layer)  # None: this layer has no RoPE (SmolLM3)
        self.attn = Attention(
            self.num_heads,
            head_dim,
            spec.attention_scale or head_dim**-0.5,
            self.num_kv_heads,
            backend,
            sliding_window=spec.sliding_windows[layer],
            softcap=spec.attn_softcap,
            sinks=spec.attn_sinks,
        )

    def forward(
        self, hidden: torch.Tensor, ropes: dict[str, Rope], rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size], or [len(rows), hidden_size]: every
        token's K/V is stored, the output projected only for `rows`."""
        qkv = self.qkv_proj(hidden)
        if isinstance(self.q_norm, ShardedRMSNorm) and isinstance(self.k_norm, ShardedRMSNorm):
            q, k, v = qkv.split([n * self.head_dim for n in self.head_split], dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)  # OLMo 2
        # One view as heads, one split: [T, H, D], [T, KH, D] x 2 (2 ops, not 5, per layer)
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split(self.head_split, dim=1)
        if isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm):
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3, Gemma 3: per head, before RoPE
        if self.rope is not None:
            q, k = apply_rotary_qk(q, k, ropes[self.rope])
        out = self.attn(q, k, v)  # [T, H * D]
        if rows is not None:
            out = out[rows]
        return self.o_proj(out)


def _qk_norms(
    config: Any, spec: DecoderSpec, qkv: QKVParallelLinear
) -> tuple[nn.Module | None, nn.Module | None]:
    """q/k norms per head (Qwen3, Gemma 3), over the whole projections (OLMo 2), or none."""
    eps, head_dim = config.rms_norm_eps, qkv.head_dim
    if spec.qk_norm_whole:
        tp_rank = get_tp_group().rank
        q_size, kv_size = qkv.num_heads * head_dim, qkv.num_kv_heads * head_dim
        q_total = config.num_attention_heads * head_dim
        kv_total = config.num_key_value_heads * head_dim
        q_norm = ShardedRMSNorm(eps, q_total, tp_rank * q_size, q_size)
        return q_norm, ShardedRMSNorm(eps, kv_total, qkv.kv_head_start * head_dim, kv_size)
    if spec.qk_norm:
        offset = spec.unit_offset_norms
        return RMSNorm(head_dim, eps, offset), RMSNorm(head_dim, eps, offset)
    return None, None


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=spec.mlp_bias, glu=True
        )
        self.fused_silu = spec.activation == "silu"
        self.act = gated_activation(spec.activation)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = None
        if self.fused_silu:  # fused into the matmul where it can be
            hidden = self.gate_up_proj.silu_and_mul(x)
        if hidden is None:
            hidden = self.act(self.gate_up_proj(x))
        return self.down_proj(hidden)


class LlamaDecoderLayer(nn.Module):
    """One block, in the style `spec.block` names (spec.py); HF's norm names."""

    def __init__(self, config: Any, spec: DecoderSpec, layer: int, backend: AttentionBackend):
        super().__init__()
        self.self_attn: nn.Module = (  # a family's own: DeepSeek's latent attention
            LlamaAttention(config, spec, layer, backend)
            if spec.attention is None
            else spec.attention(config, layer, backend)
        )
        self.mlp = LlamaMLP(config, spec) if spec.mlp is None else spec.mlp(config, layer)
        self.block, self.residual_scale = spec.block, spec.residual_scale

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, spec.unit_offset_norms)

        if spec.block != "post":
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if spec.block == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if spec.block != "pre":
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: dict[str, Rope],
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block input, residual stream so far) -> (block output, residual stream), of
        every token or only of `rows` (whose K/V are stored all the same). The output is
        added to the stream by the next block's (or the final) norm."""
        if self.block == "post":
            return self._post_norm_forward(hidden, residual, ropes, rows)
        if residual is None:  # first layer: the embeddings are the residual stream
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, ropes, rows)
        if rows is not None:
            residual = residual[rows]
        if self.block == "sandwich":
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm.add_and_norm(
                self._scaled(hidden), residual
            )
            return self._scaled(self.post_feedforward_layernorm(self.mlp(hidden))), residual
        hidden, residual = self.post_attention_layernorm.add_and_norm(
            self._scaled(hidden), residual
        )
        return self._scaled(self.mlp(hidden)), residual

    def _post_norm_forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: dict[str, Rope],
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2: sublayers read the stream itself and their outputs are normed."""
        residual = hidden if residual is None else hidden + residual
        attended = self.post_attention_layernorm(self.self_attn(residual, ropes, rows))
        if rows is not None:
            residual = residual[rows]
        residual = residual + self._scaled(attended)
        return self._scaled(self.post_feedforward_layernorm(self.mlp(residual))), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as added to the stream (Granite's residual_multiplier)."""
        return x if self.residual_scale == 1.0 else x * self.residual_scale


class StageMissing(nn.Module):
    """A layer another pipeline stage holds: no parameters, never called."""


def lm_head_cost(config: Any) -> float:
    """The LM head's weights in decoder layers' worth (the pipeline's split balances
    the weights each stage reads per decode step; parallel_state.partition_layers)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return config.vocab_size * hidden / (attention + mlp)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, backend: AttentionBackend) -> None:
        super().__init__()
        stage = get_pp_group()
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.start, self.end = stage.layer_range(config.num_hidden_layers, lm_head_cost(config))
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first or (self.is_last and tied):  # the last: for its tied head
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_scale = spec.embedding_scale
        used = {spec.rope_of_layer(i) for i in range(config.num_hidden_layers)}
        self.rotary_embs = nn.ModuleDict(
            {
                name: RotaryEmbedding(head_dim_of(config), params, config.max_position_embeddings)
                for name, params in spec.rope_tables(config).items()
                if name in used
            }
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, spec, i, backend)
            if self.start <= i < self.end
            else StageMissing()
            for i in range(config.num_hidden_layers)
        )
        self.norm: RMSNorm | None = None
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, spec.unit_offset_norms)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The table of most layers (the config's own, when there is one)."""
        embs = self.rotary_embs
        return embs[DEFAULT_ROPE] if DEFAULT_ROPE in embs else next(iter(embs.values()))  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        received: Activations | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> Any:
        """The last stage (or the only one): normed hidden [T, hidden], or only its
        `output_rows` (the LM head's: the last layer then projects and runs its MLP for
        those rows alone, since no later layer reads the others). A stage before it:
        (hidden, residual) for the next. A stage after the first starts from what it
        `received`."""
        residual: torch.Tensor | None = None
        if received is None:
            assert self.embed_tokens is not None
            hidden = self.embed_tokens(input_ids)  # [T, hidden]
            if self.embedding_scale != 1.0:  # Gemma rounds the scale to the dtype first
                hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        else:
            hidden, residual = received
        ropes = {name: emb(positions, hidden.dtype) for name, emb in self.rotary_embs.items()}
        last = self.end - 1 if self.norm is not None else None
        layers = itertools.islice(self.layers, self.start, self.end)  # no new ModuleList
        for i, layer in enumerate(layers, self.start):
            hidden, residual = layer(hidden, residual, ropes, output_rows if i == last else None)
        assert residual is not None, "a stage has at least one layer"
        if self.norm is None:
            return hidden, residual
        return self.norm.add_and_norm(hidden, residual)[0]

    def holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (under `model.`) belongs to this stage."""
        if name.startswith("layers."):
            return self.start <= int(name.split(".")[1]) < self.end
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None
        if name.startswith("norm."):
            return self.norm is not None
        return True


class LlamaForCausalLM(nn.Module):
    """HF names: model.layers.N.self_attn.{q,k,v}_proj -> qkv_proj, mlp.{gate,up}_proj -> gate_up_proj."""

    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.spec = self.decoder_spec(config)
        self.model = LlamaModel(config, self.spec, backend)
        self.lm_head: ParallelLMHead | None = None
        if self.model.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if getattr(config, "tie_word_embeddings", False):
                assert self.model.embed_tokens is not None
                self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=DecoderSpec.sliding_windows_of(config),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        received: Activations | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> Any:
        """input_ids, positions [T] int64 -> hidden [T, hidden], or [len(output_rows),
        hidden]; inside forward_context(). A pipeline stage: see LlamaModel.forward."""
        return self.model(input_ids, positions, received, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (the last stage)."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        logits = self.lm_head.compute_logits(hidden)
        if self.spec.logits_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / self.spec.logits_divisor
        if self.spec.final_softcap is not None:  # Gemma 2: capped to (-cap, cap)
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def skips_weight(self, name: str) -> bool:
        """Checkpoint tensors another pipeline stage loads (weights.load_weights)."""
        if name.startswith("lm_head."):
            return self.lm_head is None
        return name.startswith("model.") and not self.model.holds_weight(name[len("model.") :])

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def kv_layer_windows(self) -> tuple[int, tuple[int | None, ...]]:
        """(global index of this stage's first attention layer, every layer's sliding
        window): what the KV cache groups are planned from (kvflow/kv_groups.py)."""
        return self.model.start, self.spec.sliding_windows


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer (`config.sliding_window`)."""

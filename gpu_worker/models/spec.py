"""`DecoderSpec`: what distinguishes the dense decoder families, read from the HF config.

Every family runs the one decoder of llama.py; the spec switches its options:

    block "pre"       x + attn(norm(x)), then + mlp(norm(.))               Llama, Qwen, Phi-3
    block "sandwich"  x + post_norm(attn(norm(x))), same around the MLP   Gemma 2/3
    block "post"      x + post_norm(attn(x)), same around the MLP         OLMo 2

plus per-layer sliding windows and RoPE tables (None: a layer without RoPE, SmolLM3),
q/k norms per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2), the
attention scale, logit soft-cap and sinks (gpt-oss), Gemma's (1 + w) norms and embedding
scale, and Granite's embedding, residual and logit multipliers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kvflow.gpu_worker.layers.rope_scaling import rope_parameters

DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # an RMSNorm over head_dim on every q and k head, before RoPE
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    qk_norm_whole: bool = False  # OLMo 2: the norms span the whole q / k projection
    block: str = "pre"  # "pre", "sandwich" or "post" (module docstring)
    unit_offset_norms: bool = False  # Gemma: norms scale by (1 + weight)
    activation: str = "silu"  # the MLP's gate activation
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: attention logits capped
    attn_sinks: bool = False  # gpt-oss: a learned sink logit per head (layers/attention.py)
    final_softcap: float | None = None  # Gemma 2: final logits capped
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden), Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: residual_multiplier on each block's output
    logits_divisor: float = 1.0  # Granite: logits_scaling
    # RoPE tables by name and each layer's table (None: no RoPE); empty = the config's
    # one table on every layer.
    ropes: dict[str, dict[str, Any]] = field(default_factory=dict)
    rope_layers: tuple[str | None, ...] = ()
    # A family's MLP of layer i, (config, i) -> module (a mixture of experts); None: LlamaMLP
    mlp: Callable[[Any, int], nn.Module] | None = None
    # A family's attention of layer i, (config, i, backend) -> module with LlamaAttention's
    # forward(hidden, ropes, rows) (DeepSeek's latent attention); None: LlamaAttention
    attention: Callable[[Any, int, Any], nn.Module] | None = None

    @staticmethod
    def sliding_windows_of(config: Any) -> tuple[int | None, ...]:
        window = getattr(config, "sliding_window", None)
        if not getattr(config, "use_sliding_window", True):
            window = None  # Qwen keeps a window size in the config but switches it off
        layer_types = getattr(config, "layer_types", None) or []
        if layer_types:
            return tuple(window if t == "sliding_attention" else None for t in layer_types)
        return (window,) * config.num_hidden_layers

    def rope_tables(self, config: Any) -> dict[str, dict[str, Any]]:
        return self.ropes or {DEFAULT_ROPE: rope_parameters(config)}

    def rope_of_layer(self, layer: int) -> str | None:
        return self.rope_layers[layer] if self.rope_layers else DEFAULT_ROPE


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

"""GGUF tensors that become one Hugging Face tensor of another name and layout.

Most GGUF tensors map one to one onto an HF tensor (a rename, gguf_archs.py's
block_tensors). A `TensorHook` covers the rest: it reads the tensors `blk.N.<kind>.<suffix>`
of its kinds (in order, dequantized, numpy shapes) and `combine` makes the HF tensor
`model.layers.N.<target>`:

    attn_k_b [H, r, N] + attn_v_b [H, V, r] ──▶ self_attn.kv_b_proj [H (N + V), r]
                                                (DeepSeek's MLA, newer llama.cpp files)
    ffn_gate_exps [E, I, H] + ffn_up_exps ──▶ mlp.experts.gate_up_proj [E, H, 2I]
                                                (gpt-oss: gate and up in alternate columns)
    ffn_down_exps [E, H, I] ──▶ mlp.experts.down_proj [E, I, H]   (gpt-oss)
    exp_probs_b.bias, attn_sinks.weight ──▶ HF names with no suffix pattern

A hooked tensor is float only: its blocks are not kept (the results are stacked experts,
or matrices the block kernels do not serve).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Combine = Callable[[list[np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class TensorHook:
    kinds: tuple[str, ...]  # blk.N.<kind>.<suffix>, the GGUF tensors read, in this order
    suffix: str  # weight or bias
    target: str  # the HF tensor under model.layers.N
    combine: Combine


def same(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0]


def transposed(parts: list[np.ndarray]) -> np.ndarray:
    """Stacked experts [E, rows, cols] -> [E, cols, rows] (HF stores them input-major)."""
    return parts[0].swapaxes(-1, -2)


def interleaved(parts: list[np.ndarray]) -> np.ndarray:
    """gate [..., I, (H)] and up -> HF's fused gate_up with gate j at column 2j, up j at
    2j + 1: weights [E, H, 2I] (transposed), biases [E, 2I]."""
    gate, up = parts
    fused = np.stack([gate, up], axis=-2 if gate.ndim == 3 else -1)  # pair each gate/up row
    if gate.ndim == 3:  # [E, I, 2, H] -> [E, 2I, H] -> [E, H, 2I]
        return fused.reshape(gate.shape[0], -1, gate.shape[-1]).swapaxes(-1, -2)
    return fused.reshape(gate.shape[0], -1)


def kv_b_joined(parts: list[np.ndarray]) -> np.ndarray:
    """DeepSeek's kv_b_proj from llama.cpp's split halves: per head the N key rows (stored
    transposed as [r, N]) then the V value rows, each over the r latent columns."""
    k_b, v_b = parts
    rows = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [H, N + V, r]
    return rows.reshape(-1, rows.shape[-1])

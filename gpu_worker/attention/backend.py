"""The attention backend interface and the registry of its implementations.

A backend stores this step's keys/values into the paged KV cache and computes causal
attention of every request's query tokens over that request's whole context. It reads
the step layout only from `AttentionMetadata` (see attn_metadata.py for the diagram).
One backend instance is shared by all attention layers of a model, so it may keep
per-step state (plans, scratch buffers) keyed by the metadata object of the step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvflow.gpu_worker.attn_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value at metadata.slot_mapping (slot -1: not stored), then causal
        attention of each request's query tokens over its whole paged context.

        `sliding_window = W` lets the query at position p see keys at positions
        p - W < k <= p (W keys, itself included), as HF's sliding-window mask does.
        `softcap = c` caps each scaled logit s as c * tanh(s / c) before the softmax.
        `sinks` adds exp(sinks[h]) to the softmax denominator of query head h (a logit
        with no value: the keys' weights sum to less than 1; softcap.py).
        Rows of padding tokens (past query_start_loc[-1]) are zeros.
        """
        ...


BACKEND_NAMES = ("torch", "cpu", "triton")


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance: "torch" (any device, the reference), "cpu" (torch with the
    native paged decode and causal prefill kernels; plain torch where they cannot be
    built) or "triton" (CUDA).
    """
    if name in ("torch", "cpu"):
        from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
        from kvflow.kernels.cpu.paged_decode import load_paged_decode
        from kvflow.kernels.cpu.prefill_attention import load_prefill_attention

        if name == "torch":
            return TorchAttentionBackend()
        return TorchAttentionBackend(load_paged_decode(), load_prefill_attention())
    if name == "triton":
        # Imported lazily: triton is only needed (and importable) where CUDA kernels run.
        from kvflow.gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")

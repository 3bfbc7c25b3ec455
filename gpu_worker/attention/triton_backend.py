"""Attention backend on the Triton kernels: `store_kv`, then one `paged_attention` launch.

Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before
`kvflow.kernels` was imported (slow, for tests). Every request of a step, whatever its
kind (decode, chunked prefill over a cached prefix, fresh prefill), is served by the same
launch, reading its context from the paged cache after this step's K/V were stored.

A quantized cache (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`, kernels/kv_codec.py) takes
the same two launches: `store_kv` quantizes the rows it writes and `paged_attention` reads
codes and scales, except that a request with no cached prefix attends this step's K/V as
computed (passed as `fresh_kv`), as the torch backend does; decodes, chunks over a cached
prefix and prefix-cache hits read the dequantized cache. Scratch and head sizes come from
the query (a quantized row is head_dim + 4 wide: see `kv_codec.head_dim_of`).

Multi-head latent attention (DeepSeek, `forward_latent`) runs on the same two kernels:
its cache has one plane of latent rows (kv_cache.py), which a stride-0 view presents as
both K and V planes, so the paged kernel runs it as multi-query attention of the
absorbed queries (attention/mla_torch.py) over whole rows; the output's first
kv_lora_rank dims are the attended latent (the rest, the rope part's, is dropped).
Every request takes the absorbed form here, prefills included.

Split-KV (flash-decoding) partials need an fp32 scratch buffer. The backend keeps one and
grows it when a step needs more; to capture CUDA graphs, construct the backend with a
fixed `num_splits` (the grid must not change between replays) and call `reserve_scratch`
for the largest captured batch before capturing, so no allocation happens inside.
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.attention.mla_torch import absorb_query, expand_output, latent_attention
from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels.launch_utils import num_sms
from kvflow.kernels.paged_attention import SplitKVScratch, choose_num_splits, paged_attention
from kvflow.kernels.store_kv import store_kv


class TritonAttentionBackend:
    """Implements `AttentionBackend` (see backend.py) with kvflow's Triton kernels."""

    def __init__(self, num_splits: int | None = None) -> None:
        # None: choose per step from its sizes (eager mode); an int: always that many.
        self.num_splits = num_splits
        self._scratch: SplitKVScratch | None = None
        # An unbound (empty) cache only occurs in the memory-profiling pass, where every
        # request is a whole prefill; the torch backend serves that pass.
        self._no_cache_fallback = TorchAttentionBackend()

    def reserve_scratch(
        self, max_tokens: int, num_heads: int, head_dim: int, max_splits: int, device: torch.device
    ) -> None:
        """Preallocate split-KV scratch for launches up to these sizes."""
        self._scratch = SplitKVScratch.allocate(max_tokens, num_heads, head_dim, max_splits, device)

    def _scratch_for(
        self, num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
    ) -> SplitKVScratch:
        scratch = self._scratch
        if scratch is None or not scratch.fits(num_tokens, num_heads, head_dim, num_splits):
            if scratch is not None:  # grow, never shrink: steps alternate in size
                num_tokens = max(num_tokens, scratch.acc.shape[0])
                num_splits = max(num_splits, scratch.acc.shape[2])
            scratch = SplitKVScratch.allocate(num_tokens, num_heads, head_dim, num_splits, device)
            self._scratch = scratch
        return scratch

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4)]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # key and value may be views of the fused qkv output (row stride of all heads):
        # both kernels take each tensor's own strides, so nothing is copied here.
        # The paged kernel has no logit soft-capping: capped layers (Gemma 2) take the
        # torch backend, which has it (on the same CUDA tensors, eager steps). Attention
        # sinks (gpt-oss) it has: they start each row's online softmax.
        if kv_cache.numel() == 0 or softcap is not None:
            return self._no_cache_fallback.forward(
                query, key, value, kv_cache, metadata, scale, sliding_window, softcap, sinks
            )
        store_kv(key, value, kv_cache, metadata.slot_mapping)
        return self._attend(query, key, value, kv_cache, metadata, scale, sliding_window, sinks)

    def forward_latent(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, N]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, R], rotated
        latent: torch.Tensor,  # [num_tokens, 1, r + R]
        kv_b: torch.Tensor,  # [num_heads, N + V, r]
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, r + R]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, V]
        """Multi-head latent attention (module docstring): store, then one launch."""
        if kv_cache.numel() == 0:
            plans = self._no_cache_fallback
            return latent_attention(plans, q_nope, q_pe, latent, kv_b, kv_cache, metadata, scale)
        planes = kv_cache.expand(2, -1, -1, -1, -1)  # K and V: the same rows, no copy
        store_kv(latent, latent, planes, metadata.slot_mapping)  # both writes land alike
        query = absorb_query(q_nope, q_pe, kv_b)  # [num_tokens, num_heads, r + R]
        out = self._attend(query, latent, latent, planes, metadata, scale, None, None)
        return expand_output(out[..., : kv_b.shape[2]], kv_b, q_nope.shape[-1])

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """The paged kernel's launch over this step's stored K/V."""
        num_tokens, num_heads, head_dim = query.shape
        num_splits = self.num_splits
        if num_splits is None:
            num_splits = choose_num_splits(
                metadata.num_reqs, kv_cache.shape[3], metadata.max_query_len,
                metadata.max_seq_len, num_sms(query.device),
            )  # fmt: skip
        scratch = None
        if num_splits > 1:
            scratch = self._scratch_for(num_tokens, num_heads, head_dim, num_splits, query.device)
        return paged_attention(
            query, kv_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables, scale, sliding_window,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
            num_splits=num_splits, scratch=scratch, fresh_kv=(key, value), sinks=sinks,
        )  # fmt: skip

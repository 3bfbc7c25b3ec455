"""CUDA graphs of the model's forward pass for decode-only steps.

A decode step of a small model is mostly kernel-launch and Python overhead: ~300
launches per step for a 30-layer model, each a few microseconds of GPU work. Capturing
the forward once per batch size and replaying it removes that overhead.

What is captured: `model(input_ids, positions)` for a batch of `size` requests with one
query token each, reading its inputs from static buffers. A step with `n` decodes
replays the smallest captured size >= n; the padding rows get token 0 at position 0,
slot -1 (nothing stored), seq_len 1, and their outputs are ignored. Mixed or prefill
steps, and batches larger than the largest size, run eagerly.

Invariants replays rely on:
- The attention backend is the Triton one with a fixed split count per captured size
  (the grid cannot change between replays) and its split-KV scratch is allocated before
  capture and kept alive here, so an eager step that grows the backend's scratch never
  frees memory a graph writes to.
- Block tables are as wide as `max_model_len` allows, so any request fits; columns past a
  request's last block are never read (the kernel stops at seq_len).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.attention.triton_backend import TritonAttentionBackend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata, forward_context
from kvflow.gpu_worker.graph_inputs import StaticDecodeInputs
from kvflow.kernels.launch_utils import num_sms
from kvflow.kernels.paged_attention import SplitKVScratch, choose_num_splits

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (at most 512), ascending."""
    ladder = [1, 2, 4, 8, *range(16, 513, 16)]
    sizes = [s for s in ladder if s <= max_num_seqs]
    if max_num_seqs <= 512 and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(sizes)


def capture_decode_graphs(
    model: nn.Module,
    sizes: list[int],
    max_model_len: int,
    block_size: int,
    device: torch.device,
    num_groups: int = 1,  # KV cache groups (kvflow/kv_groups.py): static tables each
) -> DecodeGraphs | None:
    """`model`'s decode graphs for every size (its KV cache bound), or None where its
    attention backend is not the Triton one (the torch backend plans on the host)."""
    layers = model.attention_layers()  # type: ignore[operator]  # every decoder has it
    backend = layers[0].backend
    if not isinstance(backend, TritonAttentionBackend):
        return None
    if any(layer.softcap is not None for layer in layers):
        return None  # soft-capped layers (Gemma 2) take the torch backend: it plans on the host
    graphs = DecodeGraphs(model, backend, sizes, max_model_len, block_size, device, num_groups)
    graphs.capture(layers[0].num_heads, layers[0].head_dim, layers[0].num_kv_heads)
    return graphs


class DecodeGraphs:
    """One captured forward per batch size; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        backend: TritonAttentionBackend,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.static = StaticDecodeInputs.allocate(
            self.sizes[-1], math.ceil(max_model_len / block_size), device, num_groups
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, hidden] written by each replay
        self._scratch: SplitKVScratch | None = (
            None  # the split-KV buffers the graphs write to, kept alive
        )
        self.num_replays = 0

    def can_run(self, md: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and md.is_decode_only
            and md.num_reqs <= self.sizes[-1]
            and all(
                group.block_tables.shape[1] <= self.static.block_tables.shape[1]
                for group in (md, *md.group_metadata)
            )
        )

    @torch.inference_mode()
    def capture(self, num_heads: int, head_dim: int, num_kv_heads: int) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        sms = num_sms(self.static.input_ids.device)
        splits = {
            s: choose_num_splits(s, num_kv_heads, 1, self.max_model_len, sms) for s in self.sizes
        }
        self.backend.reserve_scratch(
            self.sizes[-1], num_heads, head_dim, max(splits.values()), self.static.input_ids.device
        )
        self._scratch = self.backend._scratch
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in reversed(self.sizes):
                self.backend.num_splits = splits[size]
                self._capture_one(size, pool)
        finally:
            self.backend.num_splits = None  # eager steps choose per step again
        torch.cuda.synchronize()

    def _capture_one(self, size: int, pool: Any) -> None:
        metadata = self.static.metadata(size, self.max_model_len)
        ids, positions = self.static.input_ids[:size], self.static.positions[:size]
        with forward_context(metadata):  # warm-up: compiles Triton kernels, fills caches
            self.model(ids, positions)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with forward_context(metadata), torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = self.model(ids, positions)
        self.graphs[size] = graph

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode-only forward, by graph replay."""
        n = md.num_reqs
        size = next(s for s in self.sizes if s >= n)
        self.static.load(input_ids, positions, md, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]

"""A hand-driven paged KV cache for running kvflow models step by step in tests.

`PagedRunner` plays the model runner's part at the smallest size: it owns one KV cache
tensor per attention layer, hands out blocks in a shuffled order (so a request's blocks
are never contiguous), builds the AttentionMetadata of a step from (request, tokens)
chunks and returns the logits of every token of the step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from kvflow.gpu_worker.attn_metadata import AttentionMetadata, forward_context


class PagedRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}
        self.max_blocks = num_blocks
        param = next(model.parameters())
        for layer in model.attention_layers():  # type: ignore[operator]
            planes = layer.kv_planes  # K and V, or one MLA latent row
            shape = (planes, num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = torch.full(shape, float("nan"), dtype=param.dtype)

    def _slots(self, request: str, count: int) -> list[int]:
        blocks = self.blocks.setdefault(request, [])
        start = self.num_tokens.get(request, 0)
        slots = []
        for pos in range(start, start + count):
            if pos // self.block_size == len(blocks):
                blocks.append(self.free_blocks.pop())
            slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.num_tokens[request] = start + count
        return slots

    def metadata(
        self, chunks: Sequence[tuple[str, Sequence[int]]], num_padding: int = 0
    ) -> tuple[AttentionMetadata, list[int]]:
        """Metadata of one step running `chunks` (+ padding rows) and the tokens' positions."""
        slots, positions, starts, seq_lens = [], [], [0], []
        for request, tokens in chunks:
            first = self.num_tokens.get(request, 0)
            slots += self._slots(request, len(tokens))
            positions += range(first, first + len(tokens))
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(first + len(tokens))
        tables = torch.zeros(len(chunks), self.max_blocks, dtype=torch.int32)
        for row, (request, _) in enumerate(chunks):
            tables[row, : len(self.blocks[request])] = torch.tensor(self.blocks[request])
        num_tokens = starts[-1] + num_padding
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(len(tokens) for _, tokens in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            logits_indices=torch.arange(num_tokens),
        )
        return md, positions + [0] * num_padding

    def step(
        self, chunks: Sequence[tuple[str, Sequence[int]]], num_padding: int = 0
    ) -> list[torch.Tensor]:
        """Run one step; the logits [len(tokens), vocab] of each chunk, in order."""
        md, positions = self.metadata(chunks, num_padding)
        input_ids = [t for _, tokens in chunks for t in tokens] + [0] * num_padding
        with torch.inference_mode(), forward_context(md):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden[md.logits_indices])  # type: ignore[operator]
        return list(logits[: md.query_start_loc_cpu[-1]].split([len(t) for _, t in chunks]))


def full_prefill_logits(model: nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """Logits of every token of one prompt run as a single prefill with no KV cache bound."""
    n = len(tokens)
    md = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        logits_indices=torch.arange(n),
    )
    layers = model.attention_layers()  # type: ignore[operator]
    bound = [layer.kv_cache for layer in layers]
    for layer in layers:  # unbound: the backend's no-cache path, and no runner cache is touched
        layer.kv_cache = torch.empty(0)
    try:
        with torch.inference_mode(), forward_context(md):
            hidden = model(torch.tensor(tokens), torch.arange(n))
            return model.compute_logits(hidden)  # type: ignore[operator]
    finally:
        for layer, cache in zip(layers, bound):
            layer.kv_cache = cache


@pytest.fixture(scope="session")
def paged_runner() -> Callable[..., PagedRunner]:
    return PagedRunner


@pytest.fixture(scope="session")
def prefill_logits() -> Callable[[nn.Module, Sequence[int]], torch.Tensor]:
    return full_prefill_logits


@pytest.fixture(scope="session")
def models_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_models")

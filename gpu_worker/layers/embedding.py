"""Vocabulary-parallel token embedding and LM head.

The vocabulary is cut into tp equal ranges of `ceil(vocab / tp)` rows; rank r holds rows
[r * per_rank, (r + 1) * per_rank) and the last rank's tail past `vocab` is zero padding:

    vocab = 10, tp = 4 -> per_rank = 3:  r0 [0 1 2] r1 [3 4 5] r2 [6 7 8] r3 [9 pad pad]

The embedding looks up only ids in its range (others give zeros) and all-reduces; the
LM head computes its slice of the logits and all-gathers them, dropping the padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.gpu_worker.layers.linear import copy_checked, new_parameter
from kvflow.gpu_worker.parallel_state import get_tp_group
from kvflow.kernels.cpu.block_linear import BlockWeights
from kvflow.kernels.cpu.int8_linear import QuantWeights
from kvflow.kernels.cpu.linear import PackedWeight, linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp.size)
        self.vocab_start = self.tp.rank * self.per_rank
        self.weight = new_parameter((self.per_rank, embedding_dim), self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint vocabulary {loaded_weight.shape[0]} != config {self.num_embeddings}"
            )
        rows = min(self.per_rank, self.num_embeddings - self.vocab_start)
        param.data[rows:].zero_()
        copy_checked(param.data[:rows], loaded_weight.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, embedding_dim]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.per_rank)
        embedded = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        embedded.mul_(in_range.unsqueeze(-1).to(embedded.dtype))
        return self.tp.all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W^T, W split by vocabulary rows; `tie_to` shares the embedding's W."""

    blocks: BlockWeights | None = None  # GGUF blocks of `weight` (block_weights.py)
    quant: QuantWeights | None = None  # `--quantization` (gpu_worker/quantization.py)
    packed_weight: PackedWeight | None = None  # gpu_worker/weight_packing.py

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        assert embedding.weight.shape == self.weight.shape
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32."""
        logits = linear(
            hidden, self.weight, None, self.blocks, self.quant, self.packed_weight
        )  # [num_rows, per_rank]
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits.float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead is not an embedding; call compute_logits()")

"""The static input buffers a decode graph reads (CUDA graphs: cuda_graphs.py; CPU
graphs: cpu_graphs.py). A replay reads its inputs from fixed addresses, so each step's
inputs are copied into rows [:n] of these buffers first.

Block tables are as wide as `max_model_len` allows, so any request fits; columns past a
request's last block are never read (the kernels stop at seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.gpu_worker.attn_metadata import AttentionMetadata


@dataclass
class StaticDecodeInputs:
    """Rows [:size] of every input a decode forward of `size` requests reads."""

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64
    query_start_loc: torch.Tensor  # [max_size + 1] int32, = arange: one token per request
    seq_lens: torch.Tensor  # [max_size] int32
    block_tables: torch.Tensor  # [max_size, max_blocks] int32

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> StaticDecodeInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_size),
            positions=zeros(max_size),
            slot_mapping=torch.full((max_size,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
            block_tables=zeros(max_size, max_blocks, dtype=torch.int32),
        )

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,  # only its length (num_reqs) is read on this path
            logits_indices=self.input_ids.new_empty(0),
        )

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, size: int
    ) -> None:
        """Copy a step's inputs into rows [:n] and reset the padding rows [n:size]."""
        n = md.num_reqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.block_tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)

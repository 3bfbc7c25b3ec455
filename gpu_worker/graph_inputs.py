"""The static input buffers a decode graph reads (CUDA graphs: cuda_graphs.py; CPU
graphs: cpu_graphs.py). A replay reads its inputs from fixed addresses, so each step's
inputs are copied into rows [:n] of these buffers first.

Block tables are as wide as `max_model_len` allows, so any request fits; columns past a
request's last block are never read (the kernels stop at seq_len). A hybrid KV cache
(kvflow/kv_groups.py) has a slot mapping and block tables per group: group 0's in
`slot_mapping` / `block_tables`, the others' in `group_slots` / `group_tables`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    group_slots: list[torch.Tensor] = field(default_factory=list)  # groups 1..: [max_size]
    group_tables: list[torch.Tensor] = field(default_factory=list)  # [max_size, max_blocks]

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks: int, device: torch.device, num_groups: int = 1
    ) -> StaticDecodeInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def no_slots() -> torch.Tensor:
            return torch.full((max_size,), -1, dtype=torch.int64, device=device)

        return cls(
            input_ids=zeros(max_size),
            positions=zeros(max_size),
            slot_mapping=no_slots(),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
            block_tables=zeros(max_size, max_blocks, dtype=torch.int32),
            group_slots=[no_slots() for _ in range(num_groups - 1)],
            group_tables=[
                zeros(max_size, max_blocks, dtype=torch.int32) for _ in range(num_groups - 1)
            ],
        )

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        md = self._metadata(size, max_seq_len)
        for slots, tables in zip(self.group_slots, self.group_tables):
            md.group_metadata.append(
                dataclasses.replace(
                    md, slot_mapping=slots[:size], block_tables=tables[:size], group_metadata=[]
                )
            )
        return md

    def _metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
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
        self.seq_lens[:n].copy_(md.seq_lens)
        all_slots = [self.slot_mapping, *self.group_slots]
        all_tables = [self.block_tables, *self.group_tables]
        for group, slots, tables in zip((md, *md.group_metadata), all_slots, all_tables):
            slots[:n].copy_(group.slot_mapping)
            tables[:n, : group.block_tables.shape[1]].copy_(group.block_tables)
            if size > n:
                slots[n:size].fill_(-1)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.seq_lens[n:size].fill_(1)

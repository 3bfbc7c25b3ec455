"""A step of short queries seen as one-token decodes, so a decode graph can run it.

A speculative verification step gives each request k + 1 query rows: its last token
and its k drafts. Attention of query row j of a request whose context is L tokens
(this step's included) reads positions 0 .. L - q_len + j, and every one of those is
in the KV cache by the time attention runs (each layer stores the step's K/V first).
So that row is exactly a one-token decode of context length L - q_len + j + 1 over the
request's block table, and the whole step is a decode-only step of `num_tokens`
"requests", which the decode kernel runs in place and a CPU decode graph of that many
rows replays (gpu_worker/cpu_graphs.py). Every other part of the forward works row by
row already. Nothing changes for the caller: the rows keep their order, so the hidden
states and the logits rows are the same.
"""

from __future__ import annotations

import dataclasses

import torch

from kvflow.gpu_worker.attn_metadata import AttentionMetadata


def as_token_decodes(md: AttentionMetadata) -> AttentionMetadata:
    """`md` with one request per query token (see the module docstring); the groups of a
    hybrid KV cache get their own tables repeated the same way."""
    starts = md.query_start_loc_cpu
    num_tokens = starts[-1]
    owners: list[int] = []  # the request of each token row
    lens: list[int] = []  # the context each row attends, itself included
    for req, seq_len in enumerate(md.seq_lens_cpu):
        q_len = starts[req + 1] - starts[req]
        owners += [req] * q_len
        lens += range(seq_len - q_len + 1, seq_len + 1)
    device = md.seq_lens.device
    owner = torch.tensor(owners, dtype=torch.int64, device=device)
    common = dict(
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_query_len=1,
        query_start_loc_cpu=list(range(num_tokens + 1)),
        seq_lens_cpu=lens,
        group_metadata=[],
    )
    rows = dataclasses.replace(md, block_tables=md.block_tables[owner], **common)  # type: ignore[arg-type]
    for group in md.group_metadata:
        rows.group_metadata.append(
            dataclasses.replace(group, block_tables=group.block_tables[owner], **common)  # type: ignore[arg-type]
        )
    return rows

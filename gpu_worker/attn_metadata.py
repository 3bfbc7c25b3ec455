"""Per-step attention metadata and the context that installs it for one forward pass.

The model runner builds one `AttentionMetadata` per step and installs it with
`forward_context(metadata)`; only attention layers (and the LM-head row selection)
read it, so model code never carries it in signatures.

Layout of a step with three requests (B = block_size = 4)::

    request         r0 (decode)   r1 (prefill chunk)     r2 (new prefill)
    context (seq)   [c c c c c|q] [c c c c|q q q]        [q q]
    query tokens                q         q q q           q q
    query_start_loc 0           1                      4        6
    seq_lens        6                 7                  2
    slot_mapping    one slot per query token: block_table[pos // B] * B + pos % B
                    (-1 marks a padding token whose K/V must not be stored)

Query tokens of a request are always the *last* `q_len` tokens of its context, so
causal masking inside a request is: query i (absolute position seq_len - q_len + i)
sees context positions 0 .. seq_len - q_len + i.

A hybrid KV cache (kvflow/kv_groups.py) has one block table per layer group: the
metadata is group 0's, and `group_metadata[g - 1]` is group g's, the same step with that
group's `slot_mapping` and `block_tables` (-1 in a table: a block that left the sliding
window, which the backends never read). Each attention layer reads its group's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_reqs] int32, context incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies: the torch backend plans its loops with these (no device syncs).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Rows of the hidden states whose logits are needed (last token of sampled requests,
    # or every prompt token when prompt logprobs were asked for).
    logits_indices: torch.Tensor  # [num_logits] int64
    # Hybrid KV cache: the metadata of groups 1.. (empty: one group).
    group_metadata: list[AttentionMetadata] = field(default_factory=list)

    def of_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.group_metadata[group - 1]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


# Called by each attention layer with its KV cache view once the step's K/V are stored
# in it: a KV connector saves layer by layer (kvflow/kv_transfer/worker/layer_save.py).
AfterLayer = Callable[[torch.Tensor], None]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    after_layer: AfterLayer | None = None


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    metadata: AttentionMetadata, after_layer: AfterLayer | None = None
) -> Iterator[ForwardContext]:
    """Install `metadata` for one forward pass; nesting is a bug, and it always clears."""
    global _current
    assert _current is None, "forward_context does not nest"
    _current = ForwardContext(metadata, after_layer)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention called outside forward_context()"
    return _current


@contextmanager
def replaced_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    """Inside a step's context, run a forward on other metadata: a CPU decode graph
    records the step's forward on its static buffers (gpu_worker/cpu_graphs.py)."""
    context = get_forward_context()
    saved, context.attn_metadata = context.attn_metadata, metadata
    try:
        yield
    finally:
        context.attn_metadata = saved
